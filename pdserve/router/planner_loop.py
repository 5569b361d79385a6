"""PlannerLoop: the router runs the SLO planner (router/slo_planner.py) on its own state every
`--planner-interval` and exports what it decided.

It reads the router's own objects, never its Prometheus text: finished requests from the
`RequestWindow` that `RequestMetrics.track` fills, waits and refusals from the admission queue,
node counts, KV usage and prefill backlog from the Cluster's node table.

It acts on nothing itself: `pdserve_planner_desired_replicas{role}` is for an autoscaler to act on
(KEDA on Kubernetes: deploy/k8s/components/planner-keda; `pdserve up`: commands/up_scaler.py).
Several routers each export their own view; the ScaledObjects take the largest.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.node_runtime.discovery.base import ROLES, Role
from pdserve.router.cluster import Cluster
from pdserve.router.request_window import RequestWindow
from pdserve.router.saturation import backlog_seconds
from pdserve.router.slo_planner import Decision, Observation, PlannerConfig, SloPlanner

log = logging.getLogger("pdserve.router.planner")
ACTIONS = ("hold", "add_prefill", "add_decode", "remove_prefill", "remove_decode", "move_to_prefill", "move_to_decode")


class PlannerLoop:
    """Samples the router every interval, asks the planner, sets the gauges."""

    def __init__(
        self,
        config: PlannerConfig,
        cluster: Cluster,
        window: RequestWindow,
        registry: CollectorRegistry,
        model_name: str,
    ) -> None:
        assert config.enabled, "a PlannerLoop runs only with --planner slo"
        self.config = config
        self.cluster = cluster
        self.window = window
        self.planner: SloPlanner | None = None
        """Made at `start`, once discovery has listed the nodes it starts from."""
        self._refused_seen = 0
        self._task: asyncio.Task | None = None
        self.desired = Gauge(
            "pdserve_planner_desired_replicas",
            "nodes the SLO planner wants per role (for KEDA/HPA to act on)",
            ["model_name", "role"],
            registry=registry,
        )
        self.pressure = Gauge(
            "pdserve_planner_pressure",
            "each role's load over its SLO at the last decision (1: at the SLO; capped at 10)",
            ["model_name", "role"],
            registry=registry,
        )
        decisions = Counter(
            "pdserve_planner_decisions", "SLO planner decisions by action", ["model_name", "action"], registry=registry
        )
        self.decisions = {a: decisions.labels(model_name, a) for a in ACTIONS}
        self.model_name = model_name

    def counts(self) -> dict[str, int]:
        """Nodes discovery lists per role."""
        found = dict.fromkeys(ROLES, 0)
        for role, _ in self.cluster.nodes:
            found[role] += 1
        return found

    def begin(self) -> SloPlanner:
        """The planner, starting from the nodes listed now (and, without --planner-max-nodes, with
        them as its budget: at least one prefill and one decode node)."""
        counts = self.counts()
        least = 1 + max(self.config.planner_min_prefill, 1)
        budget = self.config.planner_max_nodes or max(sum(counts.values()), least)
        self.planner = SloPlanner(self.config, counts[Role.PREFILL], counts[Role.DECODE], budget)
        self._export(self.planner.num_prefill, self.planner.num_decode)
        return self.planner

    def observe(self, now: float) -> Observation:
        """The router's state over the last window."""
        queue = self.cluster.queue
        self.window.refused(queue.refused - self._refused_seen, now)
        self._refused_seen = queue.refused
        ttfts, tpots, refused = self.window.read(now)
        counts = self.counts()
        used = total = 0
        backlog = 0.0
        assert self.config.ttft_slo is not None, "the planner runs with its SLOs set"
        for (role, _), node in self.cluster.nodes.items():
            if not node.usable:
                continue
            load = node.load
            if role == Role.DECODE and load.total_blocks > 0:
                used += load.total_blocks - load.free_blocks
                total += load.total_blocks
            # decode nodes prefill too (no prefill node, or every one saturated)
            seconds = backlog_seconds(load.prefilling_tokens, load.prefill_rate)
            # pending but not yet measured: count it as a full SLO's worth of work
            backlog = max(backlog, seconds if math.isfinite(seconds) else self.config.ttft_slo)
        return Observation(
            now=now,
            num_prefill=counts[Role.PREFILL],
            num_decode=counts[Role.DECODE],
            ttfts=ttfts,
            tpots=tpots,
            waiting=queue.waits(now),
            refused=refused,
            kv_usage=used / total if total else 0.0,
            prefill_backlog=backlog,
            decode_prefills=self.cluster.offload.saturated_tokens > 0,
        )

    def step(self, now: float) -> Decision:
        """One decision on the state at `now`; the gauges and the counter follow it."""
        planner = self.planner or self.begin()
        decision = planner.decide(self.observe(now))
        self.decisions[decision.action].inc()
        self._export(decision.num_prefill, decision.num_decode)
        for role in ROLES:
            self.pressure.labels(self.model_name, role).set(decision.pressure.of(role))
        if decision.action != "hold":
            log.info(
                "planner: %s -> %d prefill + %d decode (%s)",
                decision.action,
                decision.num_prefill,
                decision.num_decode,
                decision.reason,
            )
        return decision

    def _export(self, num_prefill: int, num_decode: int) -> None:
        self.desired.labels(self.model_name, Role.PREFILL).set(num_prefill)
        self.desired.labels(self.model_name, Role.DECODE).set(num_decode)

    async def start(self) -> None:
        """After the Cluster's start (its first refresh has listed the nodes)."""
        self.begin()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.planner_interval)
            try:
                self.step(time.monotonic())
            except Exception:  # never let the planner take the router down
                log.exception("planner decision failed")
