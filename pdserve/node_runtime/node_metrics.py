"""Prometheus metrics of a node process, served on its --metrics-port."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

from pdserve import __version__
from pdserve.node_runtime.engine_metrics import EngineState, cache_config_info
from pdserve.node_runtime.metrics_server import serve_metrics
from pdserve.node_runtime.vllm_metrics import LABELS, RequestFamilies


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
    from pdserve.engine.builtin import default_model_dir

    if Path(model_dir).resolve() == Path(default_model_dir()).resolve():
        return "pdserve-tiny"
    return Path(str(model_dir).rstrip("/")).name


class NodeMetrics:
    """Every series of one node: vLLM's (node_runtime.vllm_metrics, .engine_metrics) for its engine,
    and the pdserve_* ones vLLM has no name for, labelled role (prefill | decode) and model_name."""

    def __init__(
        self,
        role: str,
        model_name: str = "unknown",
        registry: CollectorRegistry | None = None,
        transport_requested: str = "tcp",
        max_model_len: int = 2048,
    ) -> None:
        self.registry = registry or add_process_collectors(CollectorRegistry())
        r, names, values = self.registry, ["role", "model_name"], (role, model_name)
        self.role = role
        self.model_name = model_name
        self.requests = RequestFamilies(r, model_name, "0", max_model_len)
        vllm_values = (model_name, "0")
        # vLLM still exports the pre-0.9 gpu_ names beside the new ones; production-stack's dashboard reads them.
        self.prefix_cache: list[tuple[Counter, Counter]] = []
        for queries, hits in (
            ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
            ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"),
        ):
            q = Counter(queries, "Prefix cache queries, in tokens.", LABELS, registry=r).labels(*vllm_values)
            h = Counter(hits, "Prefix cache hits, in tokens.", LABELS, registry=r).labels(*vllm_values)
            self.prefix_cache.append((q, h))
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

    def watch_engine(self, source: Callable[[], tuple[Any, int]], cache_info: dict[str, str]) -> None:
        """Export the engine's state (read at scrape time from `source`) and its cache configuration."""
        EngineState(self.registry, self.model_name, source)
        cache_config_info(self.registry, cache_info)

    def count_prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One request's prompt was looked up in this node's prefix cache; `cached_tokens` were found."""
        for queries, hits in self.prefix_cache:
            queries.inc(prompt_tokens)
            hits.inc(cached_tokens)

    def count_prefill(self, location: str) -> None:
        """One decode-node request prefilled at `location` ("local" or "remote")."""
        self.prefill_location.labels(*self._values, location).inc()

    def observe_load(self, load) -> None:
        self.queued_prefill_tokens.set(load.num_queued_prefill_tokens)

    def serve(self, host: str, port: int) -> None:
        if port:
            serve_metrics(host, port, self.registry)
