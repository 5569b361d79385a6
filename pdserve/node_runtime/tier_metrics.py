"""The host KV tier's series (--kv-offloading-size): read from its counters at each scrape."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.kv_tier import TierStats


class TierCollector(Collector):
    """pdserve_kv_offload_* for one node's tier (role, model_name labels, like the node's own series)."""

    def __init__(self, stats: TierStats, role: str, model_name: str, registry: CollectorRegistry) -> None:
        self.stats = stats
        self.labels = [role, model_name]
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        s, names = self.stats, ["role", "model_name"]
        blocks = CounterMetricFamily(
            "pdserve_kv_offload_blocks",
            "Host KV tier blocks by operation: stored (copied down), restored (copied back instead of "
            "recomputed), evicted (dropped from a full tier), dropped (not stored: the writer's queue was full)",
            labels=[*names, "op"],
        )
        for op in ("stored", "restored", "evicted", "dropped"):
            blocks.add_metric([*self.labels, op], getattr(s, f"{op}_blocks"))
        hits = CounterMetricFamily(
            "pdserve_kv_offload_hit_requests", "Requests that restored blocks from the host KV tier", labels=names
        )
        hits.add_metric(self.labels, s.hit_requests)
        failures = CounterMetricFamily(
            "pdserve_kv_offload_restore_failures",
            "Restores that fell back to recompute (the blocks were evicted between lookup and load)",
            labels=names,
        )
        failures.add_metric(self.labels, s.restore_failures)
        seconds = CounterMetricFamily(
            "pdserve_kv_offload_restore_seconds", "Time spent copying blocks back from the host KV tier", labels=names
        )
        seconds.add_metric(self.labels, s.restore_seconds)
        yield from (blocks, hits, failures, seconds)
