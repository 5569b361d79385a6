"""The series of the KV tiers below the pool, read from their counters at each scrape:
pdserve_kv_offload_* for the host tier (--kv-offloading-size), pdserve_kv_store_* for the shared
store (--kv-store)."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.kv_tier import RESTORE_BUCKETS

HOST_OPS = {
    "stored": "copied down",
    "restored": "copied back instead of recomputed",
    "evicted": "dropped from a full tier",
    "dropped": "not stored: the writer's queue was full",
}
STORE_OPS = {
    "stored": "written",
    "restored": "read back instead of recomputed",
    "evicted": "removed beyond the store's max",
    "dropped": "not stored: the writer's queue was full or the write failed",
    "corrupt": "refused on load (digest, key, tokens or model mismatch) and removed",
}


class TierCollector(Collector):
    """`{prefix}_*` for one node's tier (role, model_name labels, like the node's own series): its
    blocks by operation (`ops`: name -> meaning), bytes stored and restored, requests that hit it,
    restores that fell back to recompute, restores whose copy was redone synchronously, and the
    time restores took (a total and a histogram).
    `stats` is a `TierStats`."""

    def __init__(
        self,
        stats: Any,
        role: str,
        model_name: str,
        registry: CollectorRegistry,
        prefix: str = "pdserve_kv_offload",
        what: str = "Host KV tier",
        ops: dict[str, str] = HOST_OPS,
        counters: dict[str, str] | None = None,
    ) -> None:
        self.stats, self.prefix, self.what, self.ops = stats, prefix, what, ops
        self.counters = counters or {}
        """Further counters: `stats` attribute -> help (exported as `{prefix}_{attribute}`)."""
        self.labels = [role, model_name]
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        s, names, what = self.stats, ["role", "model_name"], self.what
        ops = ", ".join(f"{op} ({meaning})" for op, meaning in self.ops.items())
        blocks = CounterMetricFamily(
            f"{self.prefix}_blocks", f"{what} blocks by operation: {ops}", labels=[*names, "op"]
        )
        for op in self.ops:
            blocks.add_metric([*self.labels, op], getattr(s, f"{op}_blocks"))
        hits = CounterMetricFamily(
            f"{self.prefix}_hit_requests", f"Requests that restored blocks from the {what}", labels=names
        )
        hits.add_metric(self.labels, s.hit_requests)
        failures = CounterMetricFamily(
            f"{self.prefix}_restore_failures",
            f"Restores from the {what} that fell back to recompute (blocks gone, unreadable or refused since lookup)",
            labels=names,
        )
        failures.add_metric(self.labels, s.restore_failures)
        fallbacks = CounterMetricFamily(
            f"{self.prefix}_restore_fallbacks",
            f"Restores from the {what} whose layer-by-layer copy failed and was redone synchronously "
            "(output unchanged)",
            labels=names,
        )
        fallbacks.add_metric(self.labels, s.restore_fallbacks)
        seconds = CounterMetricFamily(
            f"{self.prefix}_restore_seconds", f"Time spent restoring blocks from the {what}", labels=names
        )
        seconds.add_metric(self.labels, s.restore_seconds)
        nbytes = CounterMetricFamily(
            f"{self.prefix}_bytes",
            f"Bytes written to (stored) and read back from (restored) the {what}",
            labels=[*names, "op"],
        )
        nbytes.add_metric([*self.labels, "stored"], s.stored_bytes)
        nbytes.add_metric([*self.labels, "restored"], s.restored_bytes)
        latency = HistogramMetricFamily(
            f"{self.prefix}_restore_latency_seconds",
            f"Time one request's restore from the {what} took (successful restores)",
            labels=names,
        )
        counts, cumulative = list(s.restore_latency), 0
        buckets = []
        for bound, count in zip([*map(str, RESTORE_BUCKETS), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        latency.add_metric(self.labels, buckets, s.restore_seconds)
        yield from (blocks, nbytes, hits, failures, fallbacks, seconds, latency)
        for name, help_text in self.counters.items():
            counter = CounterMetricFamily(f"{self.prefix}_{name}", help_text, labels=names)
            counter.add_metric(self.labels, getattr(s, name))
            yield counter


def store_collector(stats: Any, role: str, model_name: str, registry: CollectorRegistry) -> TierCollector:
    """pdserve_kv_store_* for the shared store (--kv-store)."""
    timeouts = {"timeouts": "Store lookups or reads that took too long (the store is then skipped for a while)"}
    return TierCollector(stats, role, model_name, registry, "pdserve_kv_store", "shared KV store", STORE_OPS, timeouts)
