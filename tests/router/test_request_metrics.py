"""Router request metrics observe the client's stream: tokens, finish reasons, latency, in-flight, cluster state."""

from __future__ import annotations


import pytest
from prometheus_client import CollectorRegistry

from pdserve.node_runtime.discovery import Member
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.balancer import NodeLoad
from pdserve.router.node_state import NodeState
from pdserve.router.cluster_metrics import ClusterCollector
from pdserve.router.request_metrics import RequestMetrics


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, f"{name}{labels} not exported"
    return value


async def _stream(n: int, *, fail: bool = False, cached: int = 0):
    for i in range(n):
        last = i == n - 1
        if fail and last:
            raise RuntimeError("decode node vanished")
        usage = common_pb2.Usage(prompt_tokens=5, completion_tokens=n, cached_tokens=cached)
        yield decode_pb2.GenerateEvent(
            token_ids=[i], finish_reason="length" if last else "", usage=usage if last else None
        )


async def test_tokens_reasons_and_latency():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m")
    assert [c.token_ids async for c in metrics.track(_stream(3, cached=4))] == [[0], [1], [2]]
    with pytest.raises(RuntimeError):
        async for _ in metrics.track(_stream(3, fail=True)):
            pass
    early = metrics.track(_stream(3))
    await early.__anext__()
    assert _value(registry, "pdserve_router_requests_in_flight") == 1
    await early.aclose()  # the client went away after one token
    assert _value(registry, "pdserve_router_requests_in_flight") == 0
    vllm = {"engine": "router"}
    assert _value(registry, "vllm:generation_tokens_total", **vllm) == 3 + 2 + 1
    assert _value(registry, "vllm:prompt_tokens_total", **vllm) == 5  # learnt from the final usage
    for reason, count in (("length", 1), ("error", 1), ("abort", 1), ("stop", 0)):
        assert _value(registry, "vllm:request_success_total", finished_reason=reason, **vllm) == count
    assert _value(registry, "vllm:time_to_first_token_seconds_count", **vllm) == 3
    assert _value(registry, "vllm:inter_token_latency_seconds_count", **vllm) == 2 + 1
    assert _value(registry, "vllm:time_per_output_token_seconds_count", **vllm) == 2 + 1
    assert _value(registry, "vllm:e2e_request_latency_seconds_count", **vllm) == 3
    assert _value(registry, "vllm:request_generation_tokens_count", **vllm) == 3
    assert _value(registry, "vllm:request_generation_tokens_sum", **vllm) == 3 + 2 + 1  # usage, else streamed


async def test_a_chunk_of_several_tokens_counts_one_gap_per_token():
    """ITL is per token: a chunk of 4 tokens 0.4 s after the last is 4 gaps of 0.1 s, not one of 0.4 s."""
    registry = CollectorRegistry()
    clock = RequestMetrics(registry, "m").families.clock(7, started=100.0)
    clock.tokens(1, now=100.5)
    clock.tokens(4, now=100.9)
    clock.finish("stop", now=101.0)
    vllm = {"engine": "router"}
    assert _value(registry, "vllm:time_to_first_token_seconds_sum", **vllm) == pytest.approx(0.5)
    assert _value(registry, "vllm:inter_token_latency_seconds_count", **vllm) == 4
    assert _value(registry, "vllm:inter_token_latency_seconds_sum", **vllm) == pytest.approx(0.4)
    assert _value(registry, "vllm:inter_token_latency_seconds_bucket", le="0.075", **vllm) == 0
    assert _value(registry, "vllm:inter_token_latency_seconds_bucket", le="0.15", **vllm) == 4
    assert _value(registry, "vllm:request_decode_time_seconds_sum", **vllm) == pytest.approx(0.4)
    assert _value(registry, "vllm:e2e_request_latency_seconds_sum", **vllm) == pytest.approx(1.0)
    assert _value(registry, "vllm:prompt_tokens_total", **vllm) == 7
    assert _value(registry, "vllm:request_prompt_tokens_sum", **vllm) == 7


def test_token_buckets_are_vllms_1_2_5_series():
    from pdserve.node_runtime.vllm_metrics import build_1_2_5_buckets

    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000


def test_cluster_collector_counts_usable_nodes_per_role():
    class Nodes:
        nodes: dict = {}

    def node(role: str, port: int, reported: bool, queued: int = 0) -> NodeState:
        load = NodeLoad(f"127.0.0.1:{port}", queued_prefill_tokens=queued, report_time=1.0 if reported else None)
        return NodeState(Member(role, "127.0.0.1", port, {}), None, None, None, load)

    cluster = Nodes()
    cluster.nodes = {
        ("prefill", "a"): node("prefill", 1, True, 40),
        ("prefill", "b"): node("prefill", 2, False, 7),
        ("decode", "c"): node("decode", 3, True),
    }
    registry = CollectorRegistry()
    ClusterCollector(cluster, "m", registry)
    assert _value(registry, "pdserve_router_healthy_nodes", role="prefill") == 1
    assert _value(registry, "pdserve_router_nodes", role="prefill") == 2
    assert _value(registry, "pdserve_router_healthy_nodes", role="decode") == 1
    assert _value(registry, "pdserve_router_queued_prefill_tokens") == 40
