"""Discrete-event model of decode nodes for benchmarks/trace_replay.py.

Each simulated node is a colocated engine: the real engine BlockManager (prefix cache, LRU
eviction, KV events into a real KvEventLog), a FIFO prefill queue and a decode phase. The router
side is the real one: its KvIndex is fed by the nodes' event logs through KvSubscriber.apply (the
code that consumes a node's gRPC stream), and requests are placed by KvRouter.choose_decode
(kv-aware) or DecodeBalancer.pick (wrr), on NodeLoad reports refreshed every `report_interval`
seconds as the router's health loop does.

Cost model (stated; trace tokens, i.e. 512 per trace block):
- prefill: `overhead` + uncached prompt tokens / `prefill_tok_s`, one prompt at a time per node
  (FIFO); TTFT = waiting for room and for the queue + own prefill;
- decode: `tpot` seconds per output token, in parallel with everything (not modelled: batching
  slowdown); a request holds its KV blocks from admission to its last token;
- a request that does not fit waits (FIFO) until blocks are freed.

KV tiers (optional, off by default; `simulate(host_blocks=, store_blocks=)`), after the engine's
connectors (engine/kv_tier.py, engine/kv_shared_store.py) with two stated simplifications:
- host tier, per node, LRU of `host_blocks`: a block evicted from the node's pool is copied there
  (the real tier copies a request's blocks when it finishes; copying at eviction holds the same
  blocks below the pool, without double-holding the ones still in it);
- store, shared by all nodes, LRU of `store_blocks`: every block a node computes or evicts is
  written there; the writer's event log reports it (medium store), and its eviction too, at once
  (a real node learns of a block gone from the store only when it misses it: the index here is
  exact, so the router's store hits are never stale);
- a prompt's blocks: its pool prefix first (the block manager's hit), then each next block from the
  pool, else the node's host tier, else the store, until one is in none (the order and rule of the
  router's TieredKvIndex.match_tiers); a hit in a tier refreshes its LRU place;
- a restore costs `host_restore_s` / `store_restore_s` per block, added to the prefill (serial:
  the real restore overlaps layer by layer with compute, so this over-charges it).
The tiers' events (medium host / store) go to the router's index through the same KvSubscriber as
the pool's, so the router prices tier hits as it does in service.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.block_keys import BlockKey, namespace_root, prompt_block_keys
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KvEventKind, KvEventLog, Medium
from pdserve.router.balancer import DecodeBalancer, NodeLoad
from pdserve.router.kv_index import KvIndex
from pdserve.router.kv_routing import KvRouter
from pdserve.router.kv_subscriber import KvSubscriber
from pdserve.router.prefill_offload import OffloadPolicy
from pdserve.v1 import common_pb2

BLOCK = 16  # engine tokens per trace block (the trace's 512-token blocks, scaled down)
TRACE_BLOCK_TOKENS = 512
COMPAT = "model=trace;block_size=16"
ROOT = namespace_root(COMPAT)  # the nodes key blocks as real nodes do: from their compatibility (no salt)

# Restore costs per trace block (512 tokens). BENCHMARKS.md records no restore bandwidth (its Host
# KV tier entry gives TTFTs of a CPU model; its only transfer figure, CacheStore tcp, is loopback TCP
# between two CPU processes, not a GPU host's copy), so these are stated assumptions, not
# measurements: a model that prefills 16k tok/s (the default cost model: 32 ms per block) is about
# an 8B model with GQA, 128 KiB of KV per token in fp16, so 64 MiB per block.
HOST_RESTORE_S = 64 / 1024 / 20.0
"""64 MiB from pinned host memory at an assumed 20 GB/s (PCIe 4 x16): 3.1 ms per block."""
STORE_RESTORE_S = 64 / 1024 / 5.0
"""64 MiB from the shared store at an assumed 5 GB/s (a 40 Gb/s network): 12.5 ms per block."""


@dataclass
class SimRequest:
    index: int
    arrival: float
    input_length: int
    output_length: int
    tokens: list[int]
    blocks: int  # prompt blocks (trace blocks)
    node: int = -1
    hit_blocks: int = 0
    uncached: int = 0
    ttft: float = 0.0
    block_ids: list[int] = field(default_factory=list)
    host_hits: int = 0  # prompt blocks restored from the node's host tier
    store_hits: int = 0  # prompt blocks restored from the shared store
    keys: list[BlockKey] = field(default_factory=list)  # the prompt's block keys (hashed once, for the tiers)


@dataclass(frozen=True)
class CostModel:
    prefill_tok_s: float = 16_000.0
    overhead: float = 0.02
    tpot: float = 0.03
    report_interval: float = 0.5
    host_restore_s: float = HOST_RESTORE_S
    store_restore_s: float = STORE_RESTORE_S

    def restore(self, host: int, store: int) -> float:
        """Seconds to restore `host` blocks from the host tier and `store` from the store."""
        return host * self.host_restore_s + store * self.store_restore_s


class SimStore:
    """The store shared by all nodes: an LRU of block keys, each with the node that wrote it first
    (that node's event log reports the key, medium store, and its eviction)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[BlockKey, SimNode] = OrderedDict()

    def write(self, node: SimNode, keys: Iterable[BlockKey]) -> None:
        new: list[BlockKey] = []
        for key in keys:
            if key in self.keys:
                self.keys.move_to_end(key)
            else:
                self.keys[key] = node
                new.append(key)
        node.log.stored(new, 0, Medium.STORE)
        gone: dict[str, tuple[SimNode, list[BlockKey]]] = {}
        while len(self.keys) > self.capacity:
            key, writer = self.keys.popitem(last=False)
            gone.setdefault(writer.address, (writer, []))[1].append(key)
        for writer, evicted in gone.values():
            writer.log.removed(evicted, Medium.STORE)

    def read(self, key: BlockKey) -> bool:
        """Whether the store holds `key` (a hit refreshes it)."""
        if key not in self.keys:
            return False
        self.keys.move_to_end(key)
        return True


class SimNode:
    """One node: blocks, prefill queue, the event log the router follows."""

    def __init__(
        self, i: int, num_blocks: int, index: KvIndex, host_blocks: int = 0, store: SimStore | None = None
    ) -> None:
        self.address = f"node{i}"
        self.log = KvEventLog(capacity=1 << 16)
        self.blocks = BlockManager(num_blocks, BLOCK, events=self.log)
        self.load = NodeLoad(self.address, block_size=BLOCK)
        self.sub = KvSubscriber(self.address, None, index)
        self.sub.apply(common_pb2.KvEventBatch(node_id=self.address, snapshot=True, snapshot_done=True, seq=0))
        self.waiting: deque[SimRequest] = deque()  # admitted, waiting for the prefill slot
        self.blocked: deque[SimRequest] = deque()  # waiting for KV room
        self.busy_until = 0.0
        self.busy_time = 0.0
        self.requests = 0
        self.host_blocks = host_blocks
        self.host: OrderedDict[BlockKey, None] = OrderedDict()  # the host tier's keys, LRU first
        self.store = store
        self.tier_seq = 0  # the last of the log's events the tiers have followed

    @property
    def tiered(self) -> bool:
        return self.host_blocks > 0 or self.store is not None

    def pump_events(self) -> None:
        """Deliver the node's new KV events to the router's index, as its KvEvents stream would."""
        events = self.log.since(self.sub.last_seq) or []
        if events:
            batch = common_pb2.KvEventBatch(node_id=self.address)
            for e in events:
                batch.events.add(
                    kind=int(e.kind), seq=e.seq, keys=list(e.keys), parent_key=e.parent_key, medium=e.medium.value
                )
            self.sub.apply(batch)

    def follow_pool(self) -> None:
        """Feed the tiers from the pool's new events: an evicted block goes to the host tier and the
        store, a computed (newly keyed) one to the store."""
        if not self.tiered:
            return
        events = self.log.since(self.tier_seq)
        assert events is not None, "the log dropped events the tiers had not followed"
        self.tier_seq = self.log.seq  # the tier events appended below are not the pool's: skipped next time
        for e in events:
            if e.medium is not Medium.POOL:
                continue
            if e.kind is KvEventKind.REMOVED and self.host_blocks > 0:
                self.offload(e.keys)
            if self.store is not None and e.kind in (KvEventKind.REMOVED, KvEventKind.STORED):
                self.store.write(self, e.keys)

    def offload(self, keys: Iterable[BlockKey]) -> None:
        """Copy blocks evicted from the pool into the host tier (LRU: the oldest go when it is full)."""
        new: list[BlockKey] = []
        for key in keys:
            if key in self.host:
                self.host.move_to_end(key)
            else:
                self.host[key] = None
                new.append(key)
        evicted = [self.host.popitem(last=False)[0] for _ in range(max(len(self.host) - self.host_blocks, 0))]
        self.log.stored(new, 0, Medium.HOST)
        self.log.removed(evicted, Medium.HOST)

    def tier_hits(self, keys: list[BlockKey], pool_hits: int) -> tuple[int, int, int]:
        """Past the pool prefix of `pool_hits` blocks: (pool, host, store) blocks of the leading run
        the node gets without computing, each block from its pool, else its host tier, else the store.
        (A pool block past a gap is held, so it costs nothing, as the router's index counts it.)"""
        pool = host = store = 0
        for key in keys[pool_hits:]:
            if key in self.blocks.hash_to_block:
                pool += 1
            elif key in self.host:
                self.host.move_to_end(key)
                host += 1
            elif self.store is not None and self.store.read(key):
                store += 1
            else:
                break
        return pool, host, store

    def report(self, now: float) -> None:
        queued = sum(r.uncached for r in self.waiting) * BLOCK // TRACE_BLOCK_TOKENS  # in engine tokens
        self.load.report(self.blocks.num_free_blocks, self.blocks.num_blocks, BLOCK, queued, now, COMPAT)


def output_blocks(req: SimRequest) -> int:
    """KV blocks of the output (output tokens scaled like the prompt: 512 trace tokens per block)."""
    return -(-req.output_length // TRACE_BLOCK_TOKENS)


def simulate(
    requests: list[SimRequest],
    routing: str,
    num_nodes: int,
    node_blocks: int,
    cost: CostModel,
    router: KvRouter,
    host_blocks: int = 0,
    store_blocks: int = 0,
) -> list[SimNode]:
    """Replay `requests` (sorted by arrival) with `routing`; fills each request's node, hits and ttft.
    `host_blocks` (per node) and `store_blocks` (shared) size the KV tiers; 0 leaves one out."""
    store = SimStore(store_blocks) if store_blocks > 0 else None
    nodes = [SimNode(i, node_blocks, router.index, host_blocks, store) for i in range(num_nodes)]
    wrr = DecodeBalancer(fresh_seconds=10 * cost.report_interval)
    # (time, tiebreak, kind, node, request index); requests[i].index == i
    heap: list[tuple[float, int, str, int, int]] = [(r.arrival, r.index, "arrive", -1, r.index) for r in requests]
    heapq.heapify(heap)
    tie = len(requests)
    next_report = 0.0

    def push(t: float, kind: str, node: int, i: int) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(heap, (t, tie, kind, node, i))

    def pump_all() -> None:
        for m in nodes:
            m.pump_events()

    def admit(n: SimNode, i: int, now: float) -> bool:
        r = requests[i]
        need = len(r.tokens) + output_blocks(r) * BLOCK
        if not n.blocks.can_allocate(r.tokens, reserve=output_blocks(r), root=ROOT):
            return False
        ids, cached = n.blocks.allocate(r.tokens, root=ROOT)
        ids += [n.blocks.append_block() for _ in range(n.blocks.blocks_for(need) - len(ids))]
        r.block_ids, r.hit_blocks = ids, cached // BLOCK
        if n.tiered:
            n.follow_pool()  # this allocation's evictions reach the tiers before the prompt looks there
            if not r.keys:
                r.keys = prompt_block_keys(ROOT, r.tokens, BLOCK, limit=r.blocks)
            pool, r.host_hits, r.store_hits = n.tier_hits(r.keys, r.hit_blocks)
            r.hit_blocks += pool
        got = r.hit_blocks + r.host_hits + r.store_hits
        r.uncached = max(r.input_length - got * TRACE_BLOCK_TOKENS, 0)
        n.waiting.append(r)
        pump_all()  # evictions of this allocation (and, with a store, other nodes' store evictions)
        start_prefill(n, now)
        return True

    def start_prefill(n: SimNode, now: float) -> None:
        if n.busy_until > now or not n.waiting:
            return
        r = n.waiting[0]
        service = cost.overhead + r.uncached / cost.prefill_tok_s + cost.restore(r.host_hits, r.store_hits)
        n.busy_until = now + service
        n.busy_time += service
        push(n.busy_until, "prefilled", nodes.index(n), r.index)

    while heap:
        now, _, kind, k, i = heapq.heappop(heap)
        if kind == "arrive":
            if now >= next_report:
                for n in nodes:
                    n.report(now)
                next_report = now + cost.report_interval
            r = requests[i]
            need = len(r.tokens) + output_blocks(r) * BLOCK
            loads = [n.load for n in nodes]
            if routing == "kv-aware":
                choice = router.choose_decode(loads, r.tokens, None, need, now)
                chosen = choice.node if choice else None
                if choice is not None:  # colocated nodes: the router counts the prompt each one prefills
                    OffloadPolicy.assign_local(choice.node, choice.uncached_tokens)
            else:
                chosen = wrr.pick(loads, need, now)
            chosen = chosen or min(loads, key=lambda x: x.inflight_blocks)  # all full: queue on the least loaded
            DecodeBalancer.assign(chosen, need)
            n = nodes[loads.index(chosen)]
            r.node, n.requests = loads.index(chosen), n.requests + 1
            if n.blocked or not admit(n, i, now):
                n.blocked.append(r)
        elif kind == "prefilled":
            n, r = nodes[k], requests[i]
            n.waiting.popleft()
            r.ttft = now - r.arrival
            n.blocks.cache_full_blocks(r.tokens, r.block_ids, len(r.tokens), root=ROOT)
            n.follow_pool()  # the computed blocks are written to the store
            pump_all()
            push(now + r.output_length * cost.tpot, "done", k, i)
            start_prefill(n, now)
        else:  # done: free the blocks (they stay cached), admit whoever waited for room
            n, r = nodes[k], requests[i]
            n.blocks.free_blocks(r.block_ids)
            while n.blocked and admit(n, n.blocked[0].index, now):
                n.blocked.popleft()
    return nodes
