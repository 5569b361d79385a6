"""CacheStoreClient: the sender (prefill side), a pool of channels to receivers (`Transfer`: `channel`)."""

from __future__ import annotations

import asyncio
import logging
import threading

from prometheus_client import CollectorRegistry

from cachestore.channel import Channel, Transfer
from cachestore.credentials import SessionCredentials
from cachestore.faults import FaultInjector
from cachestore.geometry import MemoryRegion, PoolGeometry, Run
from cachestore.metrics import CacheStoreMetrics
from cachestore.tls import LinkTLS
from cachestore.transport import resolve_transport


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
        tls: LinkTLS | None = None,
        model_name: str = "unknown",
        metrics: CacheStoreMetrics | None = None,
    ) -> None:
        self.region = region
        self.geometry = geometry
        self.active_transport = resolve_transport(transport)
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.metrics = metrics or CacheStoreMetrics(self.active_transport, registry, model_name)
        """`metrics`: another endpoint's over the same pool (a node that both sends and receives)."""
        self.faults = faults
        self.tls = tls
        self.metrics.tls.set(1 if tls else 0)
        """Mutual TLS to receivers over TCP (data and rdma control), or None: plaintext."""
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
        channel = self._channel_for(creds)
        transfer = Transfer(creds, channel, self.metrics, asyncio.get_running_loop())
        channel.prepare(transfer)
        return transfer

    def source(self, layer: int, run: Run) -> memoryview:
        """The pool's bytes of `run` in `layer` (a host pool; channels read a device pool by staging)."""
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
