"""What every transport's channel shares, on both sides: the sender's `Transfer` (one request's
layers to one receiver session), the `Channel` a transport implements for it, and what a channel
may read of its client (`Sender`) or a transport's receiving side may call on its server
(`Receiver`). A leaf: it imports no transport, client or server, so every transport can import it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pdserve.cachestore import wire
from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.faults import FaultInjector
from pdserve.cachestore.geometry import MemoryRegion, PoolGeometry, Run, coalesce
from pdserve.cachestore.metrics import CacheStoreMetrics
from pdserve.cachestore.tls import LinkTLS


class Sender(Protocol):
    """What a channel reads of the client that owns it (`CacheStoreClient`)."""

    region: MemoryRegion
    geometry: PoolGeometry
    secret: bytes
    metrics: CacheStoreMetrics
    faults: FaultInjector | None
    tls: LinkTLS | None

    def source(self, layer: int, run: Run) -> memoryview:
        """The sender pool's bytes of `run` in `layer` (a host pool only)."""

    def source_spans(self, layer: int, runs: list[Run], heads: tuple[int, int] | None) -> list[tuple[int, int]]:
        """(offset, length) of what `runs` of `layer` send (whole runs, or those heads' K/V slices)."""


class Receiver(Protocol):
    """What a transport's receiving side calls on the server that owns the sessions
    (`CacheStoreServer`): every write is validated by `begin_write` before a byte lands."""

    region: MemoryRegion
    geometry: PoolGeometry
    metrics: CacheStoreMetrics

    def begin_write(
        self, h: wire.Header, block_ids: Sequence[int], cut: Callable[[], None] | None = None
    ) -> tuple[Any, int, int]:
        """(session or None, wire status, writer id)."""

    def end_write(
        self,
        session: Any,
        writer: int,
        layer: int,
        block_ids: Sequence[int],
        ok: bool,
        wakes: list | None = None,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        """True if the write counts."""

    def destination(self, layer: int, first_block: int, count: int) -> memoryview:
        """The pool bytes of `count` consecutive blocks of one layer."""

    def head_destinations(self, layer: int, block_ids: Sequence[int], lo: int, hi: int) -> list[memoryview]:
        """The K and V slices of heads [lo, hi) of each block."""

    def reject(self, status: int | str) -> None:
        """Count a refused frame or connection by reason."""


class Channel(Protocol):
    """A sender's connection to one receiver; one implementation per transport
    (`local.LocalChannel`, `tcp_sender.TcpChannel`, `rdma.RdmaChannel`). Submitting only enqueues
    (any thread, the engine's included); the channel's own threads send and call the transfer's
    `_on_ack`."""

    broken: bool
    """Set once the channel can send no more; the client replaces it at the next transfer."""

    def submit(self, transfer: Transfer, layer: int, run: Run, ready_event: Any) -> None:
        """Queue one run of `layer` (`ready_event`: a CUDA event to wait on before reading, or None)."""

    def submit_layer(self, transfer: Transfer, layer: int, runs: list[Run], ready_event: Any) -> None:
        """Queue every run of `layer` (as one frame where the transport can)."""

    def prepare(self, transfer: Transfer) -> None:
        """The transfer just opened: set up what its first write needs (an rdma grant) now, on the
        channel's own threads, while the engine computes the first layer."""

    def close(self) -> None:
        """Stop sending; queued runs fail."""


class TransferError(Exception):
    """A KV transfer failed: refused by the receiver, connection lost, aborted or timed out."""


class Transfer:
    """Writes one request's layers into one receiver session.

    `write_layer` may be called from any thread (the engine thread, inside the
    per-layer hook): it only coalesces runs and enqueues them. `finish()`
    resolves when the receiver acknowledged every run.
    """

    def __init__(
        self,
        creds: SessionCredentials,
        channel: Channel,
        metrics: CacheStoreMetrics,
        loop: asyncio.AbstractEventLoop,
        heads: tuple[int, int] | None = None,
    ) -> None:
        self.creds = creds
        self.heads = heads
        """Absolute KV heads [lo, hi) this transfer writes of each block (`pdserve.cachestore.heads`);
        None: whole blocks."""
        self.metrics = metrics
        self._loop = loop
        self._lock = threading.Lock()
        self.expected = 0
        self.acked = 0
        self.error: str | None = None
        self.started_at: float | None = None
        self._waiters: list[asyncio.Future] = []
        self.wire_session = (bytes.fromhex(creds.session_id), bytes.fromhex(creds.token))
        """(session id, token) as frame headers carry them."""
        self._last_plan: tuple[tuple[int, ...], list[Run]] | None = None
        """The previous layer's source blocks and runs: every layer of a request usually sends the same blocks."""
        self._channel = channel

    def write_layer(self, layer: int, src_block_ids: list[int], ready_event=None) -> None:
        """Queue `layer` of `src_block_ids` (landing in the session's blocks, same order).

        `ready_event`: a CUDA event recorded after the layer's kernels; the sender
        thread synchronizes on it before reading (None on CPU)."""
        if len(src_block_ids) > len(self.creds.block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but the session has {len(self.creds.block_ids)}")
        if not 0 <= layer < self.creds.num_layers:
            raise ValueError(f"layer {layer} outside the session's {self.creds.num_layers} layers")
        src = tuple(src_block_ids)
        plan = self._last_plan
        if plan is not None and plan[0] == src:
            runs = plan[1]  # shared by the layers' frames, never mutated
        else:
            runs = coalesce(list(src), list(self.creds.block_ids[: len(src)]))
            self._last_plan = (src, runs)
        with self._lock:
            if self.started_at is None:
                self.started_at = time.monotonic()
            self.expected += len(runs)
        self._channel.submit_layer(self, layer, runs, ready_event)

    # called by channel threads ---------------------------------------------------------------
    def _on_ack(self, ok: bool, reason: str = "", num_runs: int = 1) -> None:
        """`num_runs` runs were acknowledged (or failed). Wakes the event loop only when that settles
        the transfer, not once per frame."""
        with self._lock:
            if ok:
                self.acked += num_runs
            elif self.error is None:
                self.error = reason
            settled = self.error is not None or self.acked >= self.expected
        if settled:
            self._wake()

    def _wake(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self.error is not None or self.acked >= self.expected:
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)
            self._waiters.clear()

    @property
    def failed(self) -> bool:
        return self.error is not None

    async def finish(self, timeout: float = 30.0) -> float:
        """Wait for every acknowledgement; returns the transfer seconds. Raises TransferError."""
        deadline = time.monotonic() + timeout
        while self.error is None and self.acked < self.expected:
            fut = self._loop.create_future()
            self._waiters.append(fut)
            if self.error is not None or self.acked >= self.expected:
                break
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(fut, max(remaining, 0.0))
            except asyncio.TimeoutError:
                self.abort("timed out")
                break
        if self.error is not None:
            self.metrics.failed.inc()
            raise TransferError(f"KV transfer of {self.creds.request_id} to {self.creds.endpoint} failed: {self.error}")
        seconds = time.monotonic() - (self.started_at or time.monotonic())
        self.metrics.transfer_seconds.observe(seconds)
        return seconds

    def abort(self, reason: str = "aborted") -> None:
        """Stop sending (queued writes are dropped); finish() raises."""
        with self._lock:
            if self.error is None:
                self.error = reason
        self._wake()
