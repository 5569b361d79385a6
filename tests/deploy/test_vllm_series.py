"""Every series that vLLM's dashboards and llm-d's endpoint picker read is exported and moves under load.

A real Prometheus scrapes a running `pdserve up` (slow; needs the apt `prometheus` package) every
200 ms while concurrent streams run. Each series below names where it is read:

- PS_MODEL: vllm-project/production-stack `helm/dashboards/vllm-model-metrics-dashboard.json`
  (commit a6c01db05f65f556235413ba8dbcfb0c01132fff), a copy of vLLM's own
  `examples/online_serving/prometheus_grafana/grafana.json`.
- PS_VLLM: production-stack `helm/dashboards/vllm-dashboard.json` and `observability/vllm-dashboard.json`
  (same commit): the engine series only. vllm:healthy_pods_total, vllm:current_qps and
  vllm:gpu_prefix_cache_hit_rate come from production-stack's own router, router_*_usage_percent and
  node_*_usage_query from its router/prometheus-adapter, vllm:num_requests_swapped from vLLM's removed
  v0 engine (v1 recomputes instead of swapping): none of them is a model server's to export.
- EPP: kubernetes-sigs/gateway-api-inference-extension `docs/proposals/003-model-server-protocol/README.md`
  (commit 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de), the metrics the endpoint picker (also llm-d's)
  scrapes from every model-server pod.

"moves": a counter or histogram grows under the load; a gauge is above zero at some scrape during
it; an info series (constant labels) is present with the labels its reader parses.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.prom_cluster import scraped_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

GROWS, BUSY, INFO = "grows", "busy", "info"
SERIES: dict[str, tuple[str, str]] = {
    "vllm:e2e_request_latency_seconds_bucket": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:e2e_request_latency_seconds_sum": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:e2e_request_latency_seconds_count": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:prompt_tokens_total": (GROWS, "PS_MODEL"),
    "vllm:generation_tokens_total": (GROWS, "PS_MODEL"),
    "vllm:time_per_output_token_seconds_bucket": (GROWS, "vLLM grafana.json, PS observability"),
    "vllm:time_per_output_token_seconds_sum": (GROWS, "vLLM grafana.json, PS observability"),
    "vllm:time_per_output_token_seconds_count": (GROWS, "vLLM grafana.json, PS observability"),
    "vllm:request_time_per_output_token_seconds_bucket": (GROWS, "PS_MODEL"),
    "vllm:request_time_per_output_token_seconds_sum": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:request_time_per_output_token_seconds_count": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:inter_token_latency_seconds_count": (GROWS, "vLLM >= 0.10 (replaces time_per_output_token)"),
    "vllm:time_to_first_token_seconds_bucket": (GROWS, "PS_MODEL, PS_VLLM"),
    "vllm:time_to_first_token_seconds_sum": (GROWS, "PS_MODEL"),
    "vllm:time_to_first_token_seconds_count": (GROWS, "PS_MODEL"),
    "vllm:request_prompt_tokens_bucket": (GROWS, "PS_MODEL"),
    "vllm:request_generation_tokens_bucket": (GROWS, "PS_MODEL"),
    "vllm:request_success_total": (GROWS, "PS_MODEL"),
    "vllm:request_queue_time_seconds_count": (GROWS, "PS_MODEL (its _sum can stay 0 on an idle node)"),
    "vllm:request_prefill_time_seconds_sum": (GROWS, "PS_MODEL"),
    "vllm:request_decode_time_seconds_sum": (GROWS, "PS_MODEL"),
    "vllm:request_max_num_generation_tokens_sum": (GROWS, "PS_MODEL"),
    "vllm:prefix_cache_queries_total": (GROWS, "vLLM >= 0.9"),
    "vllm:gpu_prefix_cache_queries_total": (GROWS, "PS_VLLM"),
    "vllm:gpu_prefix_cache_hits_total": (GROWS, "PS_VLLM (a repeated prompt hits)"),
    "vllm:prefix_cache_hits_total": (GROWS, "vLLM >= 0.9 (a repeated prompt hits)"),
    "vllm:num_requests_running": (BUSY, "PS_MODEL, PS_VLLM, EPP TotalRunningRequests"),
    "vllm:num_requests_waiting": (BUSY, "PS_MODEL, PS_VLLM, EPP TotalQueuedRequests"),
    "vllm:kv_cache_usage_perc": (BUSY, "PS_MODEL, PS_VLLM, EPP KVCacheUtilization"),
    "vllm:gpu_cache_usage_perc": (BUSY, "PS observability, EPP before vLLM 0.9"),
    "vllm:cache_config_info": (INFO, "EPP BlockSize (block_size), NumGPUBlocks (num_gpu_blocks)"),
    "vllm:lora_requests_info": (INFO, "EPP LoRA affinity (max_lora, running/waiting_lora_adapters)"),
}
INFO_LABELS = {
    "vllm:cache_config_info": {"block_size", "num_gpu_blocks", "engine"},
    # Prometheus stores no empty label: the adapter lists ("" here) are checked on the raw exposition,
    # which is what the endpoint picker reads.
    "vllm:lora_requests_info": {"max_lora"},
}
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 6 + str(i % 4) for i in range(24)]


def _load(base: str, headers: dict, stop: threading.Event, errors: list) -> None:
    """Stream completions back to back until `stop` (a repeated prompt set: prefix-cache hits)."""
    with httpx.Client(base_url=base, timeout=120, headers=headers) as client:
        i = 0
        while not stop.is_set():
            body = {"model": "pdserve-tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(r.status_code)
                for _ in r.iter_lines():
                    pass
            i += 1


def test_every_dashboard_and_endpoint_picker_series_is_exported_and_moves(tmp_path, tiny_model_dir):
    with scraped_cluster(tmp_path, tiny_model_dir, scrape_interval="200ms") as cluster:
        before = {s: cluster.value(f"sum({s})") for s, (kind, _) in SERIES.items() if kind == GROWS}
        stop, errors = threading.Event(), []
        with cluster.client() as c:
            headers = dict(c.headers)
        workers = [
            threading.Thread(target=_load, args=(cluster.http, headers, stop, errors), daemon=True) for _ in range(12)
        ]
        for w in workers:
            w.start()
        busy = [s for s, (kind, _) in SERIES.items() if kind == BUSY]
        seen: set[str] = set()

        def every_gauge_was_busy() -> bool:  # sampled while the load runs, as a 50 ms scraper would see it
            seen.update(s for s in busy if (cluster.value(f"max_over_time(sum({s})[2m:200ms])") or 0) > 0)
            return seen == set(busy)

        try:
            wait_for(every_gauge_was_busy, f"every gauge above zero under load (seen: {seen})", timeout=120)
        except AssertionError:
            raise AssertionError(f"never above zero under load: {set(busy) - seen}") from None
        finally:
            stop.set()
            for w in workers:
                w.join(180)
        assert not errors, errors
        assert seen == set(busy), f"never above zero: {set(busy) - seen}"

        def grown() -> list[str]:
            return [s for s, v in before.items() if (cluster.value(f"sum({s})") or 0) <= (v or 0)]

        try:
            wait_for(lambda: not grown(), "every counter and histogram to grow", timeout=30)
        except AssertionError:
            raise AssertionError(f"did not grow under load: {grown()}") from None
        for name, labels in INFO_LABELS.items():
            result = cluster.query(name)
            assert result and all(labels <= r["metric"].keys() for r in result), (name, result)
        assert {r["metric"]["block_size"] for r in cluster.query("vllm:cache_config_info")} != {""}
        _check_labels(cluster.targets)


def _check_labels(targets: dict[str, str]) -> None:
    """vLLM's label set (model_name, engine) on every vllm:* series of every process; model_name on every
    pdserve series of the router (retries and migrations included) and of the nodes (CacheStore included)."""
    for pod, target in targets.items():
        text = httpx.get(f"http://{target}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels.keys()
                if family.name.startswith("vllm:") and family.name not in INFO_LABELS:
                    assert {"model_name", "engine"} <= labels, (pod, sample)
                elif family.name.startswith("pdserve_"):
                    assert "model_name" in labels, (pod, sample)
        if pod == "router-0":
            assert 'pdserve_router_retries_total{model_name="pdserve-tiny"}' in text
            assert 'pdserve_router_migrations_total{model_name="pdserve-tiny"}' in text
        else:
            assert 'pdserve_cachestore_bytes_total{model_name="pdserve-tiny"' in text
            assert 'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}' in text
