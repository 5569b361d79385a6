"""KV-aware routing metrics, computed at scrape time from the KvRouter and the nodes' KV subscribers.

A collector, like router/cluster_metrics.py: the numbers are the ones routing used, never a copy
that could drift. Event lag is given per node as the seconds since its stream last delivered a
batch (`..._kv_events_age_seconds`) and the last sequence number applied; an idle node's age grows
too, so read it together with `..._kv_synced`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pdserve.router.cluster import Cluster


class KvRoutingCollector(Collector):
    """Prefix hits per node, routing decisions by reason, index size, event lag and resyncs."""

    def __init__(self, cluster: Cluster, model_name: str, registry: CollectorRegistry) -> None:
        self.cluster = cluster
        self.model_name = model_name
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m = self.model_name
        kv = self.cluster.kv_router
        decisions = CounterMetricFamily(
            "pdserve_router_routing_decisions",
            "node choices by role and reason (cold, cache, tie, balance, explore)",
            labels=["model_name", "role", "reason"],
        )
        for (role, reason), n in sorted(kv.decisions.items()):
            decisions.add_metric([m, role, reason], n)
        blocks = CounterMetricFamily(
            "pdserve_router_prefix_hit_blocks",
            "prompt blocks the chosen node held at routing time (per the KV index)",
            labels=["model_name", "role", "node"],
        )
        tokens = CounterMetricFamily(
            "pdserve_router_prefix_hit_tokens", "prompt tokens in those blocks", labels=["model_name", "role", "node"]
        )
        for (role, node), n in sorted(kv.hit_blocks.items()):
            blocks.add_metric([m, role, node], n)
            tokens.add_metric([m, role, node], kv.hit_tokens[(role, node)])
        tier_blocks = CounterMetricFamily(
            "pdserve_router_tier_hit_blocks",
            "prompt blocks the chosen node was to restore from a tier below its pool (host, store)",
            labels=["model_name", "role", "medium"],
        )
        for (role, medium), n in sorted(kv.tier_hit_blocks.items()):
            tier_blocks.add_metric([m, role, str(medium)], n)
        index = kv.index
        size = GaugeMetricFamily(
            "pdserve_router_kv_index_entries", "(key, node) entries in the KV index", labels=["model_name"]
        )
        size.add_metric([m], index.size)
        evicted = CounterMetricFamily(
            "pdserve_router_kv_index_evicted", "entries forgotten to keep the index bounded", labels=["model_name"]
        )
        evicted.add_metric([m], index.evicted)
        tiers = GaugeMetricFamily(
            "pdserve_router_kv_tier_index_entries",
            "(key, node) entries of the tiers below the pools in the KV index",
            labels=["model_name", "medium"],
        )
        for medium, tier in getattr(index, "tiers", {}).items():
            tiers.add_metric([m, str(medium)], tier.size)
        yield from (decisions, blocks, tokens, tier_blocks, size, evicted, tiers)
        yield from self._per_node()

    def _per_node(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m, now = self.model_name, time.monotonic()
        labels = ["model_name", "role", "node"]
        entries = GaugeMetricFamily(
            "pdserve_router_kv_node_entries", "keys the index holds for the node", labels=labels
        )
        synced = GaugeMetricFamily(
            "pdserve_router_kv_synced", "1 while the node's KV events are followed without a gap", labels=labels
        )
        seq = GaugeMetricFamily("pdserve_router_kv_events_seq", "last KV event sequence number applied", labels=labels)
        age = GaugeMetricFamily(
            "pdserve_router_kv_events_age_seconds",
            "seconds since the node's KV event stream last delivered",
            labels=labels,
        )
        resyncs = CounterMetricFamily(
            "pdserve_router_kv_resyncs",
            "KV event streams restarted, by reason (gap, dropped, restart, unusable)",
            labels=labels + ["reason"],
        )
        for (role, address), node in list(self.cluster.nodes.items()):
            sub = node.kv
            if sub is None:
                continue
            key = [m, role, address]
            entries.add_metric(key, sub.index.node_size(address))
            synced.add_metric(key, float(sub.index.is_synced(address)))
            seq.add_metric(key, sub.last_seq)
            if sub.last_message is not None:
                age.add_metric(key, now - sub.last_message)
            for reason, n in sorted(sub.resyncs.items()):
                resyncs.add_metric(key + [reason], n)
        yield from (entries, synced, seq, age, resyncs)
