"""CacheStoreClient and Transfer: the sender (prefill side)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from prometheus_client import CollectorRegistry

from cachestore.credentials import SessionCredentials
from cachestore.faults import FaultInjector
from cachestore.geometry import MemoryRegion, PoolGeometry, Run, coalesce
from cachestore.metrics import CacheStoreMetrics
from cachestore.transport import Channel, resolve_transport


class TransferError(Exception):
    """A KV transfer failed: refused by the receiver, connection lost, aborted or timed out."""


class Transfer:
    """Writes one request's layers into one receiver session.

    `write_layer` may be called from any thread (the engine thread, inside the
    per-layer hook): it only coalesces runs and enqueues them. `finish()`
    resolves when the receiver acknowledged every run.
    """

    def __init__(self, client: "CacheStoreClient", creds: SessionCredentials, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.creds = creds
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
        self._channel = client._channel_for(creds)

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
            self.client.metrics.failed.inc()
            raise TransferError(f"KV transfer of {self.creds.request_id} to {self.creds.endpoint} failed: {self.error}")
        seconds = time.monotonic() - (self.started_at or time.monotonic())
        self.client.metrics.transfer_seconds.observe(seconds)
        return seconds

    def abort(self, reason: str = "aborted") -> None:
        """Stop sending (queued writes are dropped); finish() raises."""
        with self._lock:
            if self.error is None:
                self.error = reason
        self._wake()


class CacheStoreClient:
    """A pool of connections to receivers, shared by all transfers of a sender."""

    def __init__(
        self,
        region: MemoryRegion,
        geometry: PoolGeometry,
        transport: str = "tcp",
        secret: bytes | str = b"",
        registry: CollectorRegistry | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.region = region
        self.geometry = geometry
        self.active_transport = resolve_transport(transport)
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.metrics = CacheStoreMetrics(self.active_transport, registry)
        self.faults = faults
        if self.active_transport == "rdma":  # GPUDirect or staging, decided now (registered at first use)
            from cachestore import rdma_memory
            from cachestore.rdma_verbs import verbs

            mode, reason = rdma_memory.choose(verbs(), region)
            logging.getLogger("pdserve.cachestore").info("rdma sender will register %s memory (%s)", mode, reason)
            self.metrics.set_pool_memory(mode)
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()

    async def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def open_transfer(self, creds: SessionCredentials) -> Transfer:
        if creds.block_bytes != self.geometry.block_bytes:
            raise ValueError(
                f"incompatible KV geometry: receiver blocks are {creds.block_bytes} bytes, "
                f"ours are {self.geometry.block_bytes}"
            )
        return Transfer(self, creds, asyncio.get_running_loop())

    def source(self, layer: int, run: Run) -> memoryview:
        start = self.geometry.offset(layer, run.src_block)
        return self.region.view[start : start + run.count * self.geometry.block_bytes]

    def _channel_for(self, creds: SessionCredentials) -> Channel:
        with self._lock:
            ch = self._channels.get(creds.endpoint)
            if ch is None or ch.broken:
                ch = self._make_channel(creds)
                self._channels[creds.endpoint] = ch
            return ch

    def _make_channel(self, creds: SessionCredentials) -> Channel:
        if creds.transport == "local":
            from cachestore.local import LocalChannel

            return LocalChannel(self, creds.endpoint)
        if creds.transport == "rdma":
            from cachestore.rdma import RdmaChannel

            return RdmaChannel(self, creds)
        from cachestore.tcp_sender import TcpChannel

        return TcpChannel(self, creds.endpoint)
