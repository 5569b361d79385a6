"""Calls to prefill nodes: one channel per address, compatibility checked at first contact."""

from __future__ import annotations

import grpc

from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime import cluster_tls, keepalive
from pdserve.node_runtime.grpc_errors import IncompatiblePeer
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

__all__ = ["IncompatiblePeer", "PrefillClients"]


class PrefillClients:
    """Channel + stub per prefill address; remembers which addresses passed the compatibility check.
    Channels ping their node (node_runtime.keepalive): a partitioned prefill node fails the call
    within `peer_timeout`, not at the call's --kv-timeout deadline."""

    def __init__(
        self,
        secret: str,
        compatibility: str,
        peer_timeout: float = keepalive.DEFAULT_PEER_TIMEOUT,
        tls: cluster_tls.ClusterTLS | None = None,
    ) -> None:
        self.options = keepalive.client_options(peer_timeout)
        self.tls = tls
        self.metadata = cluster_metadata(secret)
        self.compatibility = compatibility
        self._stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._checked: set[str] = set()

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._stubs:
            channel = cluster_tls.channel(address, self.tls, self.options)
            self._channels[address] = channel
            self._stubs[address] = prefill_pb2_grpc.PrefillStub(channel)
        return self._stubs[address]

    async def check(self, address: str, timeout: float = 5.0) -> None:
        """First contact: refuse a prefill node whose KV layout differs from ours."""
        if address in self._checked:
            return
        report = await self.stub(address).GetLoad(common_pb2.LoadRequest(), metadata=self.metadata, timeout=timeout)
        if report.compatibility != self.compatibility:
            raise IncompatiblePeer(
                f"prefill node {address} is incompatible: it has {report.compatibility!r}, "
                f"this decode node has {self.compatibility!r}"
            )
        self._checked.add(address)

    async def prefill(
        self, address: str, request: prefill_pb2.PrefillRequest, timeout: float
    ) -> prefill_pb2.PrefillResponse:
        await self.check(address)
        return await self.stub(address).Prefill(request, metadata=self.metadata, timeout=timeout)

    async def prepare_pull(
        self, address: str, request: prefill_pb2.PrefillRequest, timeout: float
    ) -> prefill_pb2.PullOffer:
        await self.check(address)
        return await self.stub(address).PreparePull(request, metadata=self.metadata, timeout=timeout)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
