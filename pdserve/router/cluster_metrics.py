"""Cluster-state gauges of the router, computed at scrape time from the Cluster's own view.

A collector (not gauges set in the refresh loop) so the values can never go
stale or drift from what the balancer actually uses: each scrape reads the
node table the router routes with.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pdserve.node_runtime.discovery import Role
from pdserve.router.cluster import Cluster

ROLES = ("prefill", "decode")


class ClusterCollector(Collector):
    """pdserve_router_healthy_nodes{role}, pdserve_router_nodes{role} and the queued prefill tokens."""

    def __init__(self, cluster: Cluster, model_name: str, registry: CollectorRegistry) -> None:
        self.cluster = cluster
        self.model_name = model_name
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "pdserve_router_healthy_nodes", "nodes the router may route to, by role", labels=["model_name", "role"]
        )
        known = GaugeMetricFamily(
            "pdserve_router_nodes", "nodes discovery lists, by role", labels=["model_name", "role"]
        )
        nodes = list(self.cluster.nodes.items())
        for role in ROLES:
            mine = [n for (r, _), n in nodes if r == role]
            healthy.add_metric([self.model_name, role], sum(1 for n in mine if n.usable))
            known.add_metric([self.model_name, role], len(mine))
        queued = GaugeMetricFamily(
            "pdserve_router_queued_prefill_tokens",
            "prompt tokens queued on healthy prefill nodes (last load reports)",
            labels=["model_name"],
        )
        queued.add_metric(
            [self.model_name],
            sum(n.load.queued_prefill_tokens for (r, _), n in nodes if r == Role.PREFILL and n.usable),
        )
        yield from (healthy, known, queued)
