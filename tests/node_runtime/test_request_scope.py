"""NodeRuntime.request(): one request's record in the node's registry: admission, in-flight count,
status, queue-time metric and single end."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.remote_prefill import DO_REMOTE_PREFILL, RemotePrefillPolicy
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_runtime.grpc_errors import NodeUnavailable
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_config import NodeConfig


def vllm_sample(rt: NodeRuntime, name: str, **labels: str) -> float:
    value = rt.metrics.registry.get_sample_value(name, {"model_name": "pdserve-tiny", "engine": "0", **labels})
    assert value is not None, name
    return value


def queue_time_count(rt: NodeRuntime) -> float:
    return vllm_sample(rt, "vllm:request_queue_time_seconds_count")


async def test_a_request_is_counted_observed_once_and_ended_once(tiny_model_dir):
    rt = NodeRuntime("decode", NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=64)))
    await rt.start(lambda server: None)
    ends: list[bool] = []

    async def end(record) -> None:
        ends.append(record.finished)

    try:
        async with rt.request("r1", end, event="admit") as scope:
            assert rt.inflight == 1 and rt.requests.get("r1") is scope and scope.status == RequestStatus.WAITING
            await rt.admit(scope, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
            with pytest.raises(ValueError, match="already in flight"):  # never takes over r1's outputs or end
                async with rt.request("r1", end):
                    pass
            while not scope.finished:
                scope.finished = (await asyncio.wait_for(scope.next_output(), 30)).finished
        assert scope.status == RequestStatus.FINISHED_LENGTH
        assert rt.inflight == 0 and rt.requests.get("r1") is None and ends == [True]
        assert queue_time_count(rt) == 1  # once per request, not per output
        assert vllm_sample(rt, "vllm:generation_tokens_total") == 3
        assert vllm_sample(rt, "vllm:inter_token_latency_seconds_count") == 2  # per token after the first
        assert vllm_sample(rt, "vllm:request_success_total", finished_reason="length") == 1
        assert vllm_sample(rt, "vllm:request_generation_tokens_sum") == 3
        assert vllm_sample(rt, "vllm:prefix_cache_queries_total") == 3
        info = next(m for m in rt.metrics.registry.collect() if m.name == "vllm:cache_config_info").samples[0]
        assert info.labels["num_gpu_blocks"] == "64" and info.labels["block_size"] == str(rt.engine.config.block_size)

        with pytest.raises(RuntimeError):
            async with rt.request("r2", end):
                raise RuntimeError("the servicer failed")
        assert rt.inflight == 0 and ends == [True, False]  # not finished: the node aborts it
        assert vllm_sample(rt, "vllm:request_success_total", finished_reason="abort") == 1

        rt.draining = True
        with pytest.raises(NodeUnavailable, match="draining"):
            async with rt.request("r3", end):
                pass
        assert ends == [True, False]  # never admitted, nothing to end
    finally:
        await rt.stop()


async def test_a_remote_prefill_request_moves_through_the_engine_status_machine(tiny_model_dir):
    """On a decode node the record shows WAITING_FOR_REMOTE_KV while a prefill node would fill its
    blocks, RUNNING once the KV landed, and FINISHED_* at the end: one status machine, the engine's."""
    policy = RemotePrefillPolicy(reuse=True, local_max_tokens=0)
    rt = NodeRuntime("decode", NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=64)), policy)
    await rt.start(lambda server: None)
    ends: list[RequestStatus] = []

    async def end(record) -> None:
        ends.append(record.status)

    try:
        async with rt.request("r", end) as scope:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            source = await rt.admit(scope, list(range(5, 40)), params, kv_transfer_params={DO_REMOTE_PREFILL: True})
            assert source.location == "remote" and scope.status == RequestStatus.WAITING_FOR_REMOTE_KV

            def land() -> RequestStatus:  # in the engine thread: read before its next step can finish it
                rt.engine.complete_remote_prefill("r", 7)
                return scope.status

            assert await rt.loop_thread.call(land) == RequestStatus.RUNNING
            tokens = [7]
            while not scope.finished:
                out = await asyncio.wait_for(scope.next_output(), 30)
                tokens += out.new_token_ids
                scope.finished = out.finished
        assert len(tokens) == 3 and ends == [RequestStatus.FINISHED_LENGTH] and not rt.requests
    finally:
        await rt.stop()
