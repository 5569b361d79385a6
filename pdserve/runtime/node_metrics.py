"""Prometheus metrics of a node process, served on its --metrics-port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def add_process_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """Register prometheus_client's process, platform and GC collectors on a private registry.

    Each process serves its own registry (not the global one), so the standard
    process_* / python_* series an SRE expects must be added explicitly.
    """
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class NodeMetrics:
    """pdserve_* series of one node (role label: prefill | decode)."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or add_process_collectors(CollectorRegistry())
        r = self.registry
        self.role = role
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", ["role"], buckets=BUCKETS,
                              registry=r).labels(role)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between tokens", ["role"],
                             buckets=BUCKETS, registry=r).labels(role)
        self.e2e = Histogram("pdserve_e2e_latency_seconds", "request latency", ["role"], buckets=BUCKETS,
                             registry=r).labels(role)
        self.queue_time = Histogram("pdserve_queue_time_seconds", "admission to first compute", ["role"],
                                    buckets=BUCKETS, registry=r).labels(role)
        self.running = Gauge("pdserve_requests_running", "requests running", ["role"], registry=r).labels(role)
        self.waiting = Gauge("pdserve_requests_waiting", "requests waiting", ["role"], registry=r).labels(role)
        self.kv_usage = Gauge("pdserve_kv_usage_ratio", "fraction of KV blocks in use", ["role"],
                              registry=r).labels(role)

    def observe_load(self, load) -> None:
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(1 - load.num_free_blocks / max(load.num_total_blocks, 1))

    def serve(self, host: str, port: int) -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
