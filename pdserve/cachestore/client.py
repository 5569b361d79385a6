"""CacheStoreClient: the sender (prefill side), a pool of channels to receivers (`Transfer`: `channel`)."""

from __future__ import annotations

import asyncio
import logging
import threading

from prometheus_client import CollectorRegistry

from pdserve.cachestore.channel import Channel, Transfer
from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.faults import FaultInjector
from pdserve.cachestore.geometry import MemoryRegion, PoolGeometry, Run
from pdserve.cachestore.heads import assigned_heads, check_mappable
from pdserve.cachestore.metrics import CacheStoreMetrics
from pdserve.cachestore.tls import LinkTLS
from pdserve.cachestore.transport import Transport, resolve_transport


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
        if self.active_transport == Transport.RDMA:  # GPUDirect or staging, decided now (registered at first use)
            from pdserve.cachestore import rdma_memory
            from pdserve.cachestore.rdma_verbs import verbs

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
        """A transfer into the session `creds` names; ValueError when our KV cannot land there, or when
        this sender writes nothing into it (`writes_to` says so first)."""
        heads = self.heads_for(creds)
        if heads is None:
            raise ValueError(f"this sender writes no KV heads into {creds.endpoint} (see writes_to)")
        whole = heads == () or (creds.heads() is not None and self._same_heads(creds))
        channel = self._channel_for(creds)
        sliced = None if whole else (heads[0], heads[1])
        transfer = Transfer(creds, channel, self.metrics, asyncio.get_running_loop(), sliced)
        channel.prepare(transfer)
        return transfer

    def writes_to(self, creds: SessionCredentials) -> bool:
        """Whether this sender (rank) writes any KV heads into the session (ValueError: cannot map)."""
        return self.heads_for(creds) is not None

    def heads_for(self, creds: SessionCredentials) -> tuple[int, ...] | None:
        """The handshake's compatibility check: () whole blocks, (lo, hi) those heads of each block,
        None nothing for this sender; ValueError naming what cannot map."""
        receiver, ours = creds.heads(), self.geometry.heads
        if receiver is None or ours is None:  # a side that states no heads: whole blocks of one pool each
            other = receiver if receiver is not None else ours
            if other is not None and other.tp_size > 1:
                raise ValueError(f"incompatible KV geometry: {other.describe()} but the other side states no KV heads")
            if creds.block_bytes != self.geometry.block_bytes:
                raise ValueError(
                    f"incompatible KV geometry: receiver blocks are {creds.block_bytes} bytes, "
                    f"ours are {self.geometry.block_bytes}"
                )
            return ()
        check_mappable(ours, receiver)
        return assigned_heads(ours, receiver)

    def _same_heads(self, creds: SessionCredentials) -> bool:
        receiver, ours = creds.heads(), self.geometry.heads
        return (
            receiver is not None and ours is not None and (receiver.first, receiver.count) == (ours.first, ours.count)
        )

    def source(self, layer: int, run: Run) -> memoryview:
        """The pool's bytes of `run` in `layer` (a host pool; channels read a device pool by staging)."""
        start = self.geometry.offset(layer, run.src_block)
        return self.region.view[start : start + run.count * self.geometry.block_bytes]

    def source_spans(self, layer: int, runs: list[Run], heads: tuple[int, int] | None) -> list[tuple[int, int]]:
        """(offset, length) of what `runs` of `layer` send: whole runs, or the heads' K/V slices per block."""
        geo = self.geometry
        if heads is None:
            return [(geo.offset(layer, r.src_block), r.count * geo.block_bytes) for r in runs]
        blocks = [b for r in runs for b in range(r.src_block, r.src_block + r.count)]
        return geo.head_spans(layer, blocks, *heads)

    def _channel_for(self, creds: SessionCredentials) -> Channel:
        with self._lock:
            ch = self._channels.get(creds.endpoint)
            if ch is None or ch.broken:
                ch = self._make_channel(creds)
                self._channels[creds.endpoint] = ch
            return ch

    def _make_channel(self, creds: SessionCredentials) -> Channel:
        if creds.transport == Transport.LOCAL:
            from pdserve.cachestore.local import LocalChannel

            return LocalChannel(self, creds.endpoint)
        if creds.transport == Transport.RDMA:
            from pdserve.cachestore.rdma import RdmaChannel

            return RdmaChannel(self, creds)
        from pdserve.cachestore.tcp_sender import TcpChannel

        return TcpChannel(self, creds.endpoint)
