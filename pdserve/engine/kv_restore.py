"""LayerRestores: blocks a tier below the pool copies back into it layer by layer, overlapped with compute.

A tier's `load` (engine thread, at admission) has checked that it holds the blocks and made sure
their sources cannot go away (the host tier pins its slots; the shared store has read and checked
the records into memory); it records the restore here (`add`) and returns at once. The engine then
keys the blocks into its prefix cache: from that moment every reader of them must find them
complete. The copies run later, layer by layer, so the first layers' attention runs while the
last layers are still being copied:

- `start(batch)` (the connector's `start_load`, before the forward's first layer): every restore
  recorded since starts: on a CPU pool a worker thread copies layer 0 of each of its blocks, then
  layer 1, ...; on a CUDA pool the copies are queued on a side stream (after the work already on
  the compute stream) with one event per layer.
- `wait_layer(layer)` (the connector's `wait_for_layer`, before that layer's attention): returns
  once that layer of every restore whose blocks this batch reads has landed (CPU: the worker says
  so; CUDA: the compute stream waits on the layer's event, the host does not block). Layers land
  in order, so a layer index past the pool's last one (a later pipeline stage's absolute index)
  waits for all of them, which is never too little. Waiting on every layer before any compute (a
  CUDA-graph replay) is as correct.
- `before_reuse(block)`: a block about to be handed out again whose restore has not landed (its
  prefix was evicted before any step ran) has it finished first, so no late copy lands in its
  new owner's KV.
- `finish_all()`: every restore lands now (the engine is about to give the blocks to a reader
  outside a forward: a decode node's D->P pull reads its held prefix over CacheStore).

Correctness: a restore never fails after `load` returned True. The sources stay in place until
the restore has landed (`on_done` then releases them), so a copy that raised on the worker (or
could not be queued on the side stream) is redone synchronously on the engine thread, where the
layer is waited for, and counted in `TierStats.restore_fallbacks`; only if that copy raises too
does the step fail (an error, never wrong output). Latency (`TierStats.restored`) runs from `add`
(admission) to the last layer landing: the time the KV took to be usable, queueing included.

The restores hold no pool block: the engine keys and frees them at admission as before (so
`LLMEngine.check_integrity` sees nothing new), and `before_reuse` is what keeps a late copy out of
a reused block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from pdserve.engine.kv_connector import KvConnector

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.engine.kv_pool import KVPool

log = logging.getLogger("pdserve.engine")


class RestoreStats(Protocol):
    """What a restore reports to (kv_tier.TierStats; a Protocol so this module imports no tier)."""

    restore_fallbacks: int

    def restored(self, blocks: int, nbytes: int, seconds: float) -> None: ...


CopyFn = Callable[[int, torch.Tensor, torch.Tensor], None]
"""`copy(layer, dst, src)`: copy one block's KV of one layer into the pool (tests slow it or fail it)."""


def copy_layer(layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    """The default copy: asynchronous on a CUDA pool (the caller orders it on its stream)."""
    dst.copy_(src, non_blocking=dst.is_cuda)


@dataclass(eq=False)
class Restore:
    """One request's restore: `sources[i]` ([layers, ...], as `pool.tensor[:, block]`) into `blocks[i]`."""

    blocks: list[int]
    sources: list[torch.Tensor]
    nbytes: int
    queued_at: float
    """perf_counter() when `load` recorded it: the latency's start."""
    on_done: Callable[[], None]
    """Releases the sources (the host tier unpins its slots); called once, on the engine thread."""
    block_set: frozenset[int] = frozenset()
    started: bool = False
    landed: int = 0
    """Layers whose copies are in the pool (CPU: set by the worker under the condition)."""
    landed_at: float = 0.0
    """perf_counter() when the last layer landed (CPU)."""
    error: BaseException | None = None
    """What the worker's copy raised (CPU), or the side stream's queueing (CUDA)."""
    events: list[torch.cuda.Event] = field(default_factory=list)
    """CUDA: one per layer, recorded on the side stream after that layer's copies."""
    start_event: torch.cuda.Event | None = None
    started_at: float = 0.0
    fell_back: bool = False

    def __post_init__(self) -> None:
        self.block_set = frozenset(self.blocks)


class LayerRestores:
    """Pending and in-flight restores into one pool, for one tier (see the module docstring).
    Every method but the worker's loop runs on the engine thread."""

    def __init__(self, pool: KVPool, stats: RestoreStats, name: str) -> None:
        self.pool = pool
        self.stats = stats
        self.name = name
        self.num_layers = pool.tensor.shape[0]
        self.copy: CopyFn = copy_layer
        self._queued: list[Restore] = []
        """Recorded by `add`, not started."""
        self._active: list[Restore] = []
        """Started, not yet settled (their sources still held)."""
        self._waited: list[Restore] = []
        """The active restores the current batch reads (set by `start`)."""
        self._cond = threading.Condition()
        self._work: deque[Restore] = deque()
        self._stopped = False
        self._thread: threading.Thread | None = None
        t = pool.tensor
        self._stream = torch.cuda.Stream(t.device) if t.is_cuda else None

    @property
    def pending(self) -> int:
        """Restores not yet settled (queued or in flight)."""
        return len(self._queued) + len(self._active)

    def add(
        self, blocks: list[int], sources: list[torch.Tensor], nbytes: int, queued_at: float, on_done: Callable[[], None]
    ) -> None:
        """Record a restore (`load`): its copies start with the next `start` (or `finish_all`)."""
        self._queued.append(Restore(list(blocks), sources, nbytes, queued_at, on_done))

    # --- the forward's hooks ------------------------------------------------------------------
    def start(self, batch: ForwardBatch | None) -> None:
        """Start every recorded restore; the ones whose blocks `batch` reads are what `wait_layer`
        waits for (None: all of them)."""
        if not self._queued and not self._active:  # the common step: nothing to restore
            self._waited = []
            return
        self.reap()
        queued, self._queued = self._queued, []
        for restore in queued:
            self._start(restore)
        if batch is None:
            self._waited = list(self._active)
            return
        reads = {b for table in batch.block_tables for b in table}
        self._waited = [r for r in self._active if not r.block_set.isdisjoint(reads)]

    def wait_layer(self, layer: int) -> None:
        """Return once `layer` of every restore the batch reads has landed (CUDA: once the compute
        stream waits for it)."""
        layer = min(layer, self.num_layers - 1)
        for restore in self._waited:
            self._wait(restore, layer)

    def done_step(self) -> None:
        """After the forward: settle what has landed, forget the batch."""
        self._waited = []
        self.reap()

    def before_reuse(self, block: int) -> None:
        """`block` is about to be overwritten by a new owner: its restore, if any, lands first."""
        if not self._queued and not self._active:
            return
        for restore in [*self._queued, *self._active]:
            if block in restore.block_set:
                self._finish(restore)

    def finish_all(self) -> None:
        """Every recorded restore lands now (its blocks are about to be read outside a forward)."""
        for restore in [*self._queued, *self._active]:
            self._finish(restore)

    def reap(self) -> None:
        """Settle the restores that have fully landed (their sources are released)."""
        for restore in list(self._active):
            if restore.error is not None:  # a failed copy no batch has waited for yet: redone now
                self._fall_back(restore)
            if self._landed_all(restore):
                self._settle(restore)

    def close(self) -> None:
        """Stop the worker (the engine is stopping: nothing reads the pool any more)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for restore in [*self._queued, *self._active]:
            restore.on_done()
        self._queued, self._active, self._waited = [], [], []

    # --- internals ------------------------------------------------------------------------------
    def _start(self, restore: Restore) -> None:
        restore.started, restore.started_at = True, time.perf_counter()
        self._active.append(restore)
        if self._stream is None:
            with self._cond:
                self._work.append(restore)
                self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._copy_loop, name=f"{self.name}-restore", daemon=True)
                self._thread.start()
            return
        stream, pool = self._stream, self.pool.tensor
        try:  # after whatever the compute stream has queued (the fresh blocks' last users)
            stream.wait_stream(torch.cuda.current_stream(pool.device))
            with torch.cuda.stream(stream):
                restore.start_event = torch.cuda.Event(enable_timing=True)
                restore.start_event.record(stream)
                for layer in range(self.num_layers):
                    for block, src in zip(restore.blocks, restore.sources):
                        self.copy(layer, pool[layer, block], src[layer])
                    event = torch.cuda.Event(enable_timing=layer == self.num_layers - 1)
                    event.record(stream)
                    restore.events.append(event)
        except Exception as e:  # redone on the compute stream where it is waited for
            restore.error = e

    def _copy_loop(self) -> None:
        pool = self.pool.tensor
        while True:
            with self._cond:
                while not self._work and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                restore = self._work.popleft()
            for layer in range(self.num_layers):
                try:
                    for block, src in zip(restore.blocks, restore.sources):
                        self.copy(layer, pool[layer, block], src[layer])
                except Exception as e:  # the engine thread redoes the rest (the sources are held)
                    with self._cond:
                        restore.error = e
                        self._cond.notify_all()
                    break
                with self._cond:
                    restore.landed = layer + 1
                    if restore.landed == self.num_layers:
                        restore.landed_at = time.perf_counter()
                    self._cond.notify_all()

    def _wait(self, restore: Restore, layer: int) -> None:
        if restore.error is not None:
            self._fall_back(restore)
            return
        if self._stream is not None:
            torch.cuda.current_stream(self.pool.tensor.device).wait_event(restore.events[layer])
            return
        with self._cond:
            while restore.landed <= layer and restore.error is None and not self._stopped:
                self._cond.wait()
            failed = restore.error is not None or restore.landed <= layer
        if failed:
            self._fall_back(restore)

    def _fall_back(self, restore: Restore) -> None:
        """Copy on this thread what has not landed (CPU: the worker no longer touches a restore
        once it set its error, and one it never reached because it stopped is copied whole; CUDA:
        everything again, after which no copy of either stream still reads the sources)."""
        if restore.fell_back:
            return
        with self._cond:
            if restore.error is None and restore.landed == self.num_layers:
                return  # landed after all
            first = restore.landed if self._stream is None else 0
        log.warning(
            "%s: restoring blocks %s layer by layer failed (%r): copied synchronously",
            self.name,
            restore.blocks[:4],
            restore.error,
        )
        pool = self.pool.tensor
        for layer in range(first, self.num_layers):
            for block, src in zip(restore.blocks, restore.sources):
                self.copy(layer, pool[layer, block], src[layer])
        if self._stream is not None:  # the sources are released once settled: no copy may still read them
            self._stream.synchronize()
            torch.cuda.current_stream(pool.device).synchronize()
        restore.fell_back = True
        restore.landed_at = time.perf_counter()
        self.stats.restore_fallbacks += 1

    def _landed_all(self, restore: Restore) -> bool:
        if restore.fell_back:
            return True
        if self._stream is not None:
            return restore.error is None and bool(restore.events) and restore.events[-1].query()
        with self._cond:
            return restore.landed == self.num_layers

    def _finish(self, restore: Restore) -> None:
        if not restore.started:
            self._queued.remove(restore)
            self._start(restore)
        if self._stream is not None:
            if restore.error is None:
                restore.events[-1].synchronize()
            else:
                self._fall_back(restore)
                torch.cuda.current_stream(self.pool.tensor.device).synchronize()
        else:
            self._wait(restore, self.num_layers - 1)
        self._settle(restore)

    def _settle(self, restore: Restore) -> None:
        if restore not in self._active:
            return
        self._active.remove(restore)
        if restore in self._waited:
            self._waited.remove(restore)
        if self._stream is not None and not restore.fell_back:
            assert restore.start_event is not None
            gpu_s = restore.start_event.elapsed_time(restore.events[-1]) / 1000
            seconds = restore.started_at - restore.queued_at + gpu_s
        else:
            seconds = restore.landed_at - restore.queued_at
        restore.on_done()
        self.stats.restored(len(restore.blocks), restore.nbytes, seconds)


class RestoringConnector(KvConnector):
    """A tier below the pool whose restores go through `LayerRestores`: the connector hooks that only
    hand on to them (the host tier and the shared store both are such connectors). `restores` is
    set when the pool is registered."""

    restores: LayerRestores | None = None

    def before_reuse(self, block_id: int) -> None:
        if self.restores is not None:  # a restore into it that never ran lands first
            self.restores.before_reuse(block_id)

    def finish_loads(self) -> None:
        if self.restores is not None:
            self.restores.finish_all()

    def start_load(self, batch: ForwardBatch) -> None:
        if self.restores is not None:
            self.restores.start(batch)

    def wait_for_layer(self, layer: int) -> None:
        if self.restores is not None:
            self.restores.wait_layer(layer)

    def wait_for_save(self) -> None:
        if self.restores is not None:
            self.restores.done_step()
