"""Prometheus metrics of a node process, served on its --metrics-port."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

from node_runtime import __version__

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


def served_model_name(model_dir: str | Path) -> str:
    """The model id clients and every metric use: `pdserve-tiny` for the built-in model, else the dir name."""
    from engine.builtin import default_model_dir

    if Path(model_dir).resolve() == Path(default_model_dir()).resolve():
        return "pdserve-tiny"
    return Path(str(model_dir).rstrip("/")).name


class NodeMetrics:
    """pdserve_* series of one node, labelled role (prefill | decode) and model_name."""

    def __init__(
        self,
        role: str,
        model_name: str = "unknown",
        registry: CollectorRegistry | None = None,
        transport_requested: str = "tcp",
    ) -> None:
        self.registry = registry or add_process_collectors(CollectorRegistry())
        r, names, values = self.registry, ["role", "model_name"], (role, model_name)
        self.role = role
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", names, buckets=BUCKETS, registry=r).labels(
            *values
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "time between tokens", names, buckets=BUCKETS, registry=r
        ).labels(*values)
        self.e2e = Histogram(
            "pdserve_e2e_latency_seconds", "request latency", names, buckets=BUCKETS, registry=r
        ).labels(*values)
        self.queue_time = Histogram(
            "pdserve_queue_time_seconds", "admission to first compute", names, buckets=BUCKETS, registry=r
        ).labels(*values)
        self.running = Gauge("pdserve_requests_running", "requests running", names, registry=r).labels(*values)
        self.waiting = Gauge("pdserve_requests_waiting", "requests waiting", names, registry=r).labels(*values)
        self.kv_usage = Gauge("pdserve_kv_usage_ratio", "fraction of KV blocks in use", names, registry=r).labels(
            *values
        )
        # Static facts to join on (the RDMA->TCP fallback alert compares this with the active transport).
        Gauge(
            "pdserve_node_info",
            "constant 1; labels describe the node",
            names + ["version", "transport_requested"],
            registry=r,
        ).labels(*values, __version__, transport_requested).set(1)
        self.queued_prefill_tokens = Gauge(
            "pdserve_queued_prefill_tokens", "prompt tokens waiting to be prefilled", names, registry=r
        ).labels(*values)
        self.prefill_location = Counter(
            "pdserve_prefill_decisions",
            "decode node: requests whose prompt was prefilled here (local) or on a prefill node (remote)",
            names + ["location"],
            registry=r,
        )
        self._values = values

    def count_prefill(self, location: str) -> None:
        """One decode-node request prefilled at `location` ("local" or "remote")."""
        self.prefill_location.labels(*self._values, location).inc()

    def observe_load(self, load) -> None:
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(1 - load.num_free_blocks / max(load.num_total_blocks, 1))
        self.queued_prefill_tokens.set(load.num_queued_prefill_tokens)

    def serve(self, host: str, port: int) -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
