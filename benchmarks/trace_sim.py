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
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_keys import namespace_root
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KvEventLog
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


@dataclass(frozen=True)
class CostModel:
    prefill_tok_s: float = 16_000.0
    overhead: float = 0.02
    tpot: float = 0.03
    report_interval: float = 0.5


class SimNode:
    """One node: blocks, prefill queue, the event log the router follows."""

    def __init__(self, i: int, num_blocks: int, index: KvIndex) -> None:
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

    def pump_events(self) -> None:
        """Deliver the node's new KV events to the router's index, as its KvEvents stream would."""
        events = self.log.since(self.sub.last_seq) or []
        if events:
            batch = common_pb2.KvEventBatch(node_id=self.address)
            for e in events:
                batch.events.add(kind=int(e.kind), seq=e.seq, keys=list(e.keys), parent_key=e.parent_key)
            self.sub.apply(batch)

    def report(self, now: float) -> None:
        queued = sum(r.uncached for r in self.waiting) * BLOCK // TRACE_BLOCK_TOKENS  # in engine tokens
        self.load.report(self.blocks.num_free_blocks, self.blocks.num_blocks, BLOCK, queued, now, COMPAT)


def output_blocks(req: SimRequest) -> int:
    """KV blocks of the output (output tokens scaled like the prompt: 512 trace tokens per block)."""
    return -(-req.output_length // TRACE_BLOCK_TOKENS)


def simulate(
    requests: list[SimRequest], routing: str, num_nodes: int, node_blocks: int, cost: CostModel, router: KvRouter
) -> list[SimNode]:
    """Replay `requests` (sorted by arrival) with `routing`; fills each request's node, hit and ttft."""
    nodes = [SimNode(i, node_blocks, router.index) for i in range(num_nodes)]
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

    def admit(n: SimNode, i: int, now: float) -> bool:
        r = requests[i]
        need = len(r.tokens) + output_blocks(r) * BLOCK
        if not n.blocks.can_allocate(r.tokens, reserve=output_blocks(r), root=ROOT):
            return False
        ids, cached = n.blocks.allocate(r.tokens, root=ROOT)
        ids += [n.blocks.append_block() for _ in range(n.blocks.blocks_for(need) - len(ids))]
        r.block_ids, r.hit_blocks = ids, cached // BLOCK
        r.uncached = max(r.input_length - r.hit_blocks * TRACE_BLOCK_TOKENS, 0)
        n.waiting.append(r)
        n.pump_events()  # evictions of this allocation
        start_prefill(n, now)
        return True

    def start_prefill(n: SimNode, now: float) -> None:
        if n.busy_until > now or not n.waiting:
            return
        r = n.waiting[0]
        service = cost.overhead + r.uncached / cost.prefill_tok_s
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
            n.pump_events()
            push(now + r.output_length * cost.tpot, "done", k, i)
            start_prefill(n, now)
        else:  # done: free the blocks (they stay cached), admit whoever waited for room
            n, r = nodes[k], requests[i]
            n.blocks.free_blocks(r.block_ids)
            while n.blocked and admit(n, n.blocked[0].index, now):
                n.blocked.popleft()
    return nodes
