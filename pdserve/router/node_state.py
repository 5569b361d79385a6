"""What the router knows of one node (`NodeState`), where a request goes (`Route`), and what a
request's stream yields (`GenerateChunk`): the plain types `router.cluster.Cluster` works with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve.v1 import common_pb2
from pdserve.node_runtime.discovery import Member
from pdserve.router.balancer import NodeLoad
from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.kv_subscriber import KvSubscriber


class GenerateChunk(NamedTuple):
    """New tokens of a request's stream (and, on its last chunk, why it ended and the usage)."""

    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    usage: common_pb2.Usage | None


@dataclass
class NodeState:
    """One node as the router sees it: its channel and stubs, last load report, health and breaker."""

    member: Member
    channel: grpc.aio.Channel
    stub: Any
    """A generated DecodeStub or PrefillStub (grpc code has no types)."""
    health: health_pb2_grpc.HealthStub
    load: NodeLoad
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    draining: bool = False
    max_model_len: int = 0
    responsive: bool = True
    """False after a probe missed the health deadline (a hung node), until a probe succeeds."""
    silent_since: float | None = None
    """When the first probe of the current run of missed probes was sent (None while the node answers)."""
    stalled: bool = False
    """A stream on this node got no event within its token deadline; with a missed probe after it,
    the node is hung at once (not `hung_after` later). Cleared when a probe answers."""
    progress: int = 0
    """The decoder layers the node's engine had computed at its last load report: while it grows the
    node is working, however late its streams' next events are."""
    engine_stalled: float = 0.0
    """Seconds the node's engine thread had spent in one step without computing a layer, at its last
    load report: a wedged engine behind a node that still answers its probes."""
    probe: asyncio.Task | None = None
    kv: KvSubscriber | None = None
    """Follows the node's KV events into the router's index (kv-aware routing only)."""

    @property
    def reachable(self) -> bool:
        return self.breaker.allows and not self.draining and self.load.report_time is not None

    @property
    def usable(self) -> bool:
        return self.reachable and self.responsive


class Route(NamedTuple):
    """Where a request goes: its decode node, the prefill nodes to try in order (none: the decode
    node prefills it), and what kv-aware routing believes each of them holds of the prompt."""

    node: NodeState
    prefills: list[str]
    prefill_cached: tuple[int, ...] = ()
    """Leading prompt tokens each prefill node holds, by the KV-event index (empty: unknown)."""
