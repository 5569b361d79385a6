"""In-process stand-ins for node stubs, to drive router.cluster.Cluster without node processes.

A FakeNode answers probes at once until `frozen` (then every probe runs into its deadline, as a
SIGSTOPped or partitioned node's would). A decode node's Generate follows `script(request)`: a list
of token ids to stream, each one event, then `finish`; `None` in the list means "hang here"."""

from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from pdserve.node_runtime.discovery.base import Member
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.cluster import Cluster


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "fake")


class FakeCall:
    def __init__(self, tokens: list[int | None]) -> None:
        self.tokens = list(tokens)
        self.cancelled = False

    async def read(self):
        if not self.tokens:
            return grpc.aio.EOF
        token = self.tokens.pop(0)
        if token is None:
            await asyncio.Event().wait()  # hangs until the reader cancels it
        finish = "length" if not self.tokens else ""
        return decode_pb2.GenerateEvent(token_ids=[token], finish_reason=finish)

    def cancel(self) -> None:
        self.cancelled = True


class FakeNode:
    """Health + load + (decode) Generate of one node."""

    def __init__(self, script: Callable[[decode_pb2.GenerateRequest], list[int | None]] | None = None) -> None:
        self.frozen = False
        self.progress = 0
        """Decoder layers this node reports having computed (a test makes it grow: a busy node)."""
        self.engine_stalled = 0.0
        """Seconds its engine reports being stuck in one step (a wedged engine behind live probes)."""
        self.script = script
        self.requests: list[decode_pb2.GenerateRequest] = []

    async def _answer(self, timeout: float, value):
        if self.frozen:
            await asyncio.sleep(timeout)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
        return value

    async def Check(self, request, timeout=None):
        from grpc_health.v1 import health_pb2

        return await self._answer(
            timeout, health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        )

    async def GetLoad(self, request, metadata=None, timeout=None):
        report = common_pb2.LoadReport(
            num_free_blocks=1000,
            num_total_blocks=1000,
            block_size=16,
            max_model_len=4096,
            progress=self.progress,
            engine_stalled_seconds=self.engine_stalled,
        )
        return await self._answer(timeout, report)

    def Generate(self, request, metadata=None, timeout=None) -> FakeCall:
        self.requests.append(request)
        return FakeCall(self.script(request) if self.script else [])


async def fake_cluster(nodes: dict[tuple[str, str], FakeNode], **kwargs) -> Cluster:
    """A started Cluster whose members are `nodes` ((role, "host:port") -> FakeNode)."""
    from pdserve.node_runtime.discovery.static import StaticDiscovery

    members = [Member.parse(role, address) for role, address in nodes]
    cluster = Cluster(StaticDiscovery(members), **kwargs)
    cluster._sync_members()
    for key, fake in nodes.items():
        cluster.nodes[key].stub = fake
        cluster.nodes[key].health = fake
    await cluster.start()
    return cluster
