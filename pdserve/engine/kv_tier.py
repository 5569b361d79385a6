"""HostKvTier: KV blocks kept in host memory below the pool, so an evicted prefix is restored, not recomputed.

A connector (`pdserve.engine.kv_connector`) with vLLM's `--kv-offloading-size` semantics:

- **What goes down.** When a request finishes, its full (keyed) blocks are queued for a writer
  thread that copies each into a host slot, keyed by the block's stable key (model namespace,
  cache salt and every token before it, `engine.block_keys`). The engine thread only enqueues.
  Until a block's copy is done, the pool must not overwrite it: the block manager asks
  `before_reuse` before it hands a freed block out again, which waits for that copy (a block is
  taken oldest-first, so by then its copy has long finished). A full queue drops the offload
  (counted), never blocks serving.
- **Lookup.** On admission, after the pool's own prefix hit, `match` counts the next prompt
  blocks the tier holds. The engine allocates pool blocks for them, `load` pins their slots and
  records the restore, and the engine keys them into its prefix cache: the request then hits them
  like any cached prefix and computes only the rest. The copies run in the next forward, layer by
  layer and overlapped with compute (`pdserve.engine.kv_restore`: a worker thread on a CPU pool,
  a side stream with an event per layer on CUDA; `wait_for_layer` waits only for that layer). A
  pinned slot is never evicted, and a copy that fails is redone synchronously, so a restore never
  fails once `load` said True.
- **Eviction.** The tier is an LRU of slots; a full tier drops its least recently used block.

Correctness: a restored block is the block that was stored (same key, and the key fixes the model,
dtype, geometry, block size and salt through the namespace root). The host store is this
process's own memory, so no checksum is kept here; a store shared across nodes keeps one.

With tensor parallelism every rank keeps its heads' share of each slot; rank 0 decides and the
other ranks copy when told (`pdserve.engine.kv_tier_ranks`).

Not exercised on hardware: on a CUDA pool the store is pinned and the copies (both ways) run on
side streams; only the CPU path runs in the tests here.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_keys import BlockKey, prompt_block_keys
from pdserve.engine.kv_connector import ExternalKv
from pdserve.engine.kv_events import KvEventLog, Medium
from pdserve.engine.kv_restore import LayerRestores, RestoringConnector
from pdserve.engine.kv_tier_ranks import TierRanks

if TYPE_CHECKING:
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.request import Request

log = logging.getLogger("pdserve.engine")
MAX_PENDING_BLOCKS = 4096
"""Blocks queued for the writer at most; offloads beyond are dropped (and counted)."""


RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (seconds) of the restore-latency histogram: a few blocks from host memory take
about a millisecond, a store read over the network up to its READ_TIMEOUT_S."""


@dataclass
class TierStats:
    """Counters of one tier (read by the node's metrics from other threads; ints only grow)."""

    stored_blocks: int = 0
    stored_bytes: int = 0
    restored_blocks: int = 0
    restored_bytes: int = 0
    hit_requests: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0
    """Offloads not made: the writer's queue was full."""
    restore_failures: int = 0
    restore_fallbacks: int = 0
    """Restores whose layer-by-layer copy failed and were copied synchronously instead (output
    unchanged; `pdserve.engine.kv_restore`)."""
    restore_seconds: float = 0.0
    restore_latency: list[int] = field(default_factory=lambda: [0] * (len(RESTORE_BUCKETS) + 1))
    """Successful restores by latency: one count per RESTORE_BUCKETS bound, then one over the last
    (not cumulative; the metrics collector sums them into Prometheus buckets)."""

    def stored(self, nbytes: int) -> None:
        """One block written to the tier."""
        self.stored_blocks += 1
        self.stored_bytes += nbytes

    def restored(self, blocks: int, nbytes: int, seconds: float) -> None:
        """One request's restore: `blocks` blocks, `nbytes` bytes read back, `seconds` from its
        admission to its last layer landing in the pool."""
        self.restored_blocks += blocks
        self.restored_bytes += nbytes
        self.hit_requests += 1
        self.restore_seconds += seconds
        self.restore_latency[bisect.bisect_left(RESTORE_BUCKETS, seconds)] += 1


class HostKvTier(RestoringConnector):
    """A host-memory KV tier of `capacity_bytes` below the engine's pool."""

    def __init__(self, capacity_bytes: int, events: KvEventLog | None = None, ranks: TierRanks | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"--kv-offloading-size must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.events = events
        """The node's KV event log: the keys this tier stores and drops (medium "host")."""
        self.stats = TierStats()
        self.ranks = ranks
        """Rank 0 of a tensor-parallel engine: the other ranks, whose slots mirror ours."""
        self.pool: KVPool | None = None
        self.store: torch.Tensor | None = None
        self.slot_bytes = 0
        """Bytes of one block's KV over every layer (one host slot), once the pool is registered."""
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()
        """key -> slot, least recently used first."""
        self._free_slots: list[int] = []
        self._pins: dict[int, int] = {}
        """slot -> restores still reading it: the writer never evicts such a slot (under `_lock`)."""
        self.restores: LayerRestores | None = None
        """The restores recorded at admission and copied layer by layer in the forward."""
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, BlockKey, threading.Event]] = deque()
        self._pending: dict[int, threading.Event] = {}
        """pool block -> set once its copy to the host is done (written and read by both threads)."""
        self._wake = threading.Condition()
        self._matched: dict[str, list[BlockKey]] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._side_stream: torch.cuda.Stream | None = None

    @property
    def num_slots(self) -> int:
        return 0 if self.store is None else self.store.shape[0]

    # --- worker side -------------------------------------------------------------------------
    def register_kv_pool(self, pool: KVPool) -> None:
        self.pool = pool
        self.slot_bytes = slot_bytes = pool.block_bytes * pool.num_layers
        slots = self.capacity_bytes // slot_bytes
        if slots < 1:
            raise ValueError(
                f"--kv-offloading-size {self.capacity_bytes} bytes holds no KV block (one takes {slot_bytes} bytes)"
            )
        t = pool.tensor
        shape = (slots, t.shape[0], *t.shape[2:])  # [slots, layers, planes, heads, block_size, head_dim]
        on_cuda = t.is_cuda
        self.store = torch.empty(shape, dtype=t.dtype, pin_memory=on_cuda)
        if on_cuda:
            self._side_stream = torch.cuda.Stream(t.device)
        self._free_slots = list(range(slots - 1, -1, -1))
        self.restores = LayerRestores(pool, self.stats, "host KV tier")
        self._thread = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._thread.start()
        log.info("host KV tier: %d blocks (%.2f GiB)", slots, slots * slot_bytes / 2**30)

    # --- scheduler side ----------------------------------------------------------------------
    def request_finished(self, request: Request) -> None:
        pool = self.pool
        if pool is None:
            return
        full = request.num_computed_tokens // pool.block_size
        keys = prompt_block_keys(request.kv_root, request.all_token_ids, pool.block_size, full)
        queued = 0
        for block, key in zip(request.block_ids, keys):
            with self._lock:
                if key in self._slots:
                    self._slots.move_to_end(key)
                    continue
            if block in self._pending:
                continue  # its copy is already queued (a block shared with another request)
            if len(self._queue) + queued >= MAX_PENDING_BLOCKS:
                self.stats.dropped_blocks += 1
                continue
            done = threading.Event()
            self._pending[block] = done
            self._queue.append((block, key, done))
            queued += 1
        if queued:
            with self._wake:
                self._wake.notify()

    def before_reuse(self, block_id: int) -> None:
        super().before_reuse(block_id)
        done = self._pending.get(block_id)
        if done is not None:
            done.wait()

    def match(self, request: Request, pool_tokens: int) -> ExternalKv | None:
        if self.pool is None:
            return None
        bs = self.pool.block_size
        limit = (request.num_prompt_tokens - 1) // bs  # the last token's block is always computed
        first = pool_tokens // bs
        if first >= limit:
            return None
        keys = prompt_block_keys(request.kv_root, request.prompt_token_ids, bs, limit)[first:]
        held: list[BlockKey] = []
        with self._lock:
            for key in keys:
                if key not in self._slots:
                    break
                held.append(key)
        if not held:
            return None
        self._matched[request.request_id] = held
        return ExternalKv(load_tokens=len(held) * bs)

    def load(self, request: Request, block_ids: list[int]) -> bool:
        """Pin the slots and record the restore: the copies run layer by layer in the next forward
        (`start_load`, `wait_for_layer`). True means the KV is guaranteed: a pinned slot cannot be
        evicted, and a copy that fails is redone synchronously (`pdserve.engine.kv_restore`)."""
        keys = self._matched.pop(request.request_id, [])
        pool, restores, store = self.pool, self.restores, self.store
        if pool is None or restores is None or store is None or len(keys) != len(block_ids):
            return False
        started = time.perf_counter()
        with self._lock:  # the writer evicts no pinned slot
            slots = [self._slots.get(key) for key in keys]
            if any(slot is None for slot in slots):  # evicted since match: recompute
                self.stats.restore_failures += 1
                return False
            pinned = [slot for slot in slots if slot is not None]
            for key, slot in zip(keys, pinned):
                self._slots.move_to_end(key)
                self._pins[slot] = self._pins.get(slot, 0) + 1
        # the other ranks copy their shares now (rank 0 rewrites none of these slots while pinned)
        if self.ranks is not None and not self.ranks.all({"op": "tier_load", "blocks": block_ids, "slots": pinned}):
            self._unpin(pinned)
            self.stats.restore_failures += 1
            return False
        restores.add(
            block_ids,
            [store[slot] for slot in pinned],
            len(block_ids) * self.slot_bytes,
            started,
            lambda: self._unpin(pinned),
        )
        return True

    def _unpin(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                left = self._pins[slot] - 1
                if left:
                    self._pins[slot] = left
                else:
                    del self._pins[slot]

    def forget(self, request: Request) -> None:
        self._matched.pop(request.request_id, None)

    # --- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
            block, key, done = self._queue.popleft()
            try:
                self._store(block, key)
            except Exception:  # a failed offload only costs a later recompute
                log.exception("host KV tier: storing block %d failed", block)
            finally:
                self._pending.pop(block, None)
                done.set()

    def _store(self, block: int, key: BlockKey) -> None:
        assert self.pool is not None and self.store is not None
        with self._lock:
            if key in self._slots:
                return
            if self._free_slots:
                slot = self._free_slots.pop()
            else:  # the least recently used slot no restore is reading (those were just used: at the end)
                old = next((k for k, s in self._slots.items() if s not in self._pins), None)
                if old is None:  # every slot is being restored from: this offload is dropped
                    self.stats.dropped_blocks += 1
                    return
                slot = self._slots.pop(old)
                self.stats.evicted_blocks += 1
                if self.events is not None:
                    self.events.removed([old], Medium.HOST)
        # the slot is now neither free nor keyed: no lookup finds it while it is written
        src = self.pool.tensor[:, block]
        if self._side_stream is not None:  # CUDA: after the engine's writes, on a side stream
            self._side_stream.wait_stream(torch.cuda.current_stream(self.pool.tensor.device))
            with torch.cuda.stream(self._side_stream):
                self.store[slot].copy_(src, non_blocking=True)
            self._side_stream.synchronize()
        else:
            self.store[slot].copy_(src)
        if self.ranks is not None and not self.ranks.all({"op": "tier_store", "block": block, "slot": slot}):
            with self._lock:  # a rank lacks its share: the slot is worth nothing
                self._free_slots.append(slot)
            self.stats.dropped_blocks += 1
            return
        with self._lock:
            self._slots[key] = slot
        self.stats.stored(self.slot_bytes)
        if self.events is not None:
            self.events.stored([key], 0, Medium.HOST)

    def close(self) -> None:
        """Stop the writer and the restorer (pending offloads and restores are dropped; nothing
        waits on them after the engine stops)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        for _, _, done in list(self._queue):
            done.set()
        self._pending.clear()
        if self.restores is not None:
            self.restores.close()
