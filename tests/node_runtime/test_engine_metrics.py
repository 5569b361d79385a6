"""vLLM's engine-state series are read from the engine thread's snapshot at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.engine.llm_engine import EngineLoad
from pdserve.node_runtime.engine_metrics import EngineState, cache_config_info

LABELS = {"model_name": "m", "engine": "0"}


def test_gauges_follow_the_latest_snapshot_at_each_scrape():
    state: dict = {"load": None, "preemptions": 0}
    registry = CollectorRegistry()
    EngineState(registry, "m", lambda: (state["load"], state["preemptions"]))

    def sample(name: str, labels: dict | None = None) -> float | None:
        return registry.get_sample_value(name, LABELS if labels is None else labels)

    assert sample("vllm:num_requests_running") == 0  # before the engine thread runs: zeros, not gaps
    state["load"] = EngineLoad(
        num_free_blocks=25, num_total_blocks=100, num_running=2, num_waiting=3, num_queued_prefill_tokens=0
    )
    state["preemptions"] = 4
    assert sample("vllm:num_requests_running") == 2
    assert sample("vllm:num_requests_waiting") == 3
    assert sample("vllm:kv_cache_usage_perc") == 0.75
    assert sample("vllm:gpu_cache_usage_perc") == 0.75
    assert sample("vllm:num_preemptions_total") == 4
    lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(sample("vllm:lora_requests_info", lora) - time.time()) < 60  # vLLM's value: last update time
    state["load"] = state["load"]._replace(num_running=0, num_free_blocks=100)
    assert sample("vllm:num_requests_running") == 0 and sample("vllm:kv_cache_usage_perc") == 0


def test_cache_config_info_carries_the_block_geometry():
    registry = CollectorRegistry()
    cache_config_info(registry, {"engine": "0", "block_size": "16", "num_gpu_blocks": "512"})
    assert (
        registry.get_sample_value(
            "vllm:cache_config_info", {"engine": "0", "block_size": "16", "num_gpu_blocks": "512"}
        )
        == 1
    )
    assert b"# TYPE vllm:cache_config_info gauge" in generate_latest(registry)
