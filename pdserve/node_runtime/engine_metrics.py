"""vLLM's engine-state series of one node, read at scrape time from the engine thread's snapshot.

Scrapers that route by these (llm-d's endpoint picker polls every 50 ms) need the value of the
moment, not the one of the router's last load poll: the collector reads the EngineLoop's load
snapshot (published in every step once the batch is scheduled, and when idle) and the
scheduler's preemption count on every scrape. Names, types and labels are vLLM's (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pdserve.node_runtime.vllm_metrics import LABELS


class EngineState(Collector):
    """vllm:num_requests_running/waiting, vllm:kv_cache_usage_perc (and its pre-0.9 name
    vllm:gpu_cache_usage_perc), vllm:num_preemptions and vllm:lora_requests_info.

    `source()` returns `(load, num_preemptions)`: the last EngineLoad (None before the engine
    thread runs: the gauges read 0) and the scheduler's preemption count.
    """

    def __init__(
        self, registry: CollectorRegistry, model_name: str, source: Callable[[], tuple[Any, int]], engine: str = "0"
    ) -> None:
        self.values = [model_name, engine]
        self.source = source
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load, preemptions = self.source()
        running = waiting = 0
        usage = 0.0
        if load is not None:
            running, waiting = load.num_running, load.num_waiting
            usage = 1 - load.num_free_blocks / max(load.num_total_blocks, 1)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's pre-0.9 name, still read by dashboards).", usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.values, value)
            yield family
        preempted = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.", labels=LABELS)
        preempted.add_metric(self.values, preemptions)
        yield preempted
        # pdserve serves no LoRA adapters: none running or waiting, none loadable. vLLM's value is the
        # time of the last update (the endpoint picker keeps the newest series).
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora


def cache_config_info(registry: CollectorRegistry, labels: dict[str, str]) -> None:
    """vllm:cache_config_info: constant 1, the KV cache configuration as labels (the endpoint
    picker reads block_size and num_gpu_blocks from it)."""
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels), registry=registry).labels(
        **labels
    ).set(1)
