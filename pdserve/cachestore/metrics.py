"""Prometheus metrics of one CacheStore endpoint (server or client)."""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class CacheStoreMetrics:
    """All series carry `model_name` (the node's served model, so one query selects a model's whole
    pipeline) and `transport` (so a silent fallback from RDMA to TCP shows up).

    With no registry given, each instance gets a private one (several servers in
    one process must not collide in the default registry).
    """

    def __init__(self, transport: str, registry: CollectorRegistry | None = None, model_name: str = "unknown") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, t, m = self.registry, transport, model_name
        base = ["model_name", "transport"]
        self.bytes = Counter("pdserve_cachestore_bytes", "KV bytes moved", base + ["side"], registry=r)
        self._bytes_by_side: dict[str, Counter] = {}

        def bound(kind: type[M], name: str, doc: str, **kw) -> M:
            """A series labelled only model_name and transport, bound to this endpoint's."""
            return kind(name, doc, base, registry=r, **kw).labels(m, t)

        self.transfer_seconds = bound(
            Histogram, "pdserve_cachestore_transfer_seconds", "first write to last ack", buckets=LATENCY_BUCKETS
        )
        self.first_layer = bound(
            Histogram,
            "pdserve_cachestore_first_layer_ready_seconds",
            "session open to first complete layer",
            buckets=LATENCY_BUCKETS,
        )
        self.all_layers = bound(
            Histogram,
            "pdserve_cachestore_all_layers_ready_seconds",
            "session open to all layers landed",
            buckets=LATENCY_BUCKETS,
        )
        self.rejected = Counter("pdserve_cachestore_rejected_frames", "frames refused", base + ["reason"], registry=r)
        self.failed = bound(Counter, "pdserve_cachestore_sessions_failed", "sessions or transfers that failed")
        self.expired = bound(Counter, "pdserve_cachestore_sessions_expired", "sessions that timed out")
        self.fenced = bound(
            Counter, "pdserve_cachestore_writers_cut", "writers cut off because their session ended first"
        )
        self.accept_errors = bound(
            Counter, "pdserve_cachestore_accept_errors", "listener accept() failures (e.g. EMFILE)"
        )
        self.listener_up = bound(Gauge, "pdserve_cachestore_listener_up", "1 while the listener accepts connections")
        self.connections = bound(Gauge, "pdserve_cachestore_connections", "open sender connections")
        self.tls = bound(Gauge, "pdserve_cachestore_tls", "1 when the TCP links run over mutual TLS")
        self.active = Gauge("pdserve_cachestore_active_transport", "1 for the transport in use", base, registry=r)
        self.active.labels(m, t).set(1)
        self.pool_memory = Gauge(
            "pdserve_cachestore_rdma_pool_memory",
            "1 for the memory the rdma transport registers: host (a host pool), "
            "gpudirect (the CUDA pool itself) or staging (pinned host buffers)",
            base + ["mode"],
            registry=r,
        )
        self.transport = t
        self.model_name = m

    def set_pool_memory(self, mode: str) -> None:
        """The rdma pool registration chosen at start (`pdserve.cachestore.rdma_memory`): one label set to 1."""
        for m in ("host", "gpudirect", "staging"):
            self.pool_memory.labels(self.model_name, self.transport, m).set(1 if m == mode else 0)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, self.transport, reason).inc()

    def received_bytes(self) -> float:
        """KV bytes this endpoint has received so far (the recv side of `bytes`)."""
        labels = {"model_name": self.model_name, "transport": self.transport, "side": "recv"}
        return self.registry.get_sample_value("pdserve_cachestore_bytes_total", labels) or 0.0

    def add_bytes(self, side: str, n: int) -> None:
        """Called once per frame: the labelled child is looked up once (labels() takes a lock and builds a key)."""
        child = self._bytes_by_side.get(side)
        if child is None:
            child = self._bytes_by_side[side] = self.bytes.labels(self.model_name, self.transport, side)
        child.inc(n)
