"""What the router knows of one node (`NodeState`) and where a request goes (`Route`): the plain
types `router.cluster.Cluster` works with."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve.v1 import common_pb2
from pdserve.node_runtime.discovery import Member
from pdserve.router.balancer import NodeLoad
from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.kv_subscriber import KvSubscriber
from pdserve.router.prefill_offload import Prefilling
from pdserve.router.saturation import backlog_seconds


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

    def missed_probe(self, sent: float) -> bool:
        """A probe sent at `sent` (monotonic) got no answer in time: no new requests until one does.
        True when the node was responsive until now (worth a log line)."""
        was = self.responsive
        self.responsive = False
        if self.silent_since is None:
            self.silent_since = sent
        self.breaker.failure()
        return was

    def answered_probe(self, report: common_pb2.LoadReport, serving: bool, hung_after: float) -> bool:
        """A probe answered with `report`: the node's load, progress and health as it reports them.
        True when this answer shows a responsive node's engine newly wedged (worth a log line): one
        stuck in a step, computing no layer, for `hung_after` seconds gets no new requests, and
        attempts on it end (`hung`)."""
        wedged = report.engine_stalled_seconds >= hung_after
        newly_wedged = wedged and self.responsive
        self.responsive, self.silent_since, self.stalled = not wedged, None, False
        self.progress, self.engine_stalled = report.progress, report.engine_stalled_seconds
        self.draining = report.draining or not serving
        self.max_model_len = report.max_model_len
        self.load.report(
            report.num_free_blocks,
            report.num_total_blocks,
            report.block_size or 16,
            report.num_queued_prefill_tokens,
            time.monotonic(),
            report.compatibility,
        )
        self.breaker.success()
        return newly_wedged

    def hung(self, hung_after: float) -> bool:
        """The node has missed every health probe for `hung_after` seconds, or a stream on it stalled
        and a probe has missed since (two independent signals, so nothing waits `hung_after` more),
        or it answers its probes but its engine has been stuck in one step, computing no layer, for
        `hung_after` seconds. A node whose engine advances is busy, not hung."""
        if self.engine_stalled >= hung_after:
            return True
        if self.silent_since is None:
            return False
        return self.stalled or time.monotonic() - self.silent_since >= hung_after

    def describe(self, hung_after: float) -> dict:
        """The node as /v1/cluster shows it."""
        load = self.load
        return {
            "role": self.member.role,
            "address": self.member.address,
            "usable": self.usable,
            "hung": self.hung(hung_after),
            "progress": self.progress,
            "breaker": self.breaker.state.value,
            "free_blocks": load.free_blocks,
            "total_blocks": load.total_blocks,
            "prefilling_tokens": load.prefilling_tokens,
            "prefill_backlog_s": _finite(backlog_seconds(load.prefilling_tokens, load.prefill_rate)),
        }

    @property
    def reachable(self) -> bool:
        return self.breaker.allows and not self.draining and self.load.report_time is not None

    @property
    def usable(self) -> bool:
        return self.reachable and self.responsive


def _finite(seconds: float) -> float | None:
    """JSON has no infinity: an unmeasured backlog shows as null."""
    return round(seconds, 2) if math.isfinite(seconds) else None


class Route(NamedTuple):
    """Where a request goes: its decode node, the prefill nodes to try in order (none: the decode
    node prefills it), and what kv-aware routing believes each of them holds of the prompt."""

    node: NodeState
    prefills: list[str]
    prefill_cached: tuple[int, ...] = ()
    """Leading prompt tokens each prefill node holds, by the KV-event index (empty: unknown)."""
    prefilling: Prefilling | None = None
    """The prompt, counted on the node that prefills it from the moment it was routed (so requests
    admitted together see each other's work); None: the attempt counts it when it starts."""
