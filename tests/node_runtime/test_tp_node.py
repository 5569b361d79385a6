"""A tensor-parallel node (engine.parallel) is one unit: it serves through rank 0, and the death of
any rank is the node's death (NOT_SERVING, `failed`), with no rank left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from grpc_health.v1 import health_pb2

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.parallel.group import RankFailure
from pdserve.node_runtime.engine_loop import EngineDeadError
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_config import NodeConfig


async def test_killing_a_rank_kills_the_node(tiny_model_dir):
    rt = NodeRuntime("decode", NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=64, tensor_parallel_size=2)))
    await rt.start(lambda server: None)
    (pid,) = rt.engine.runner.ranks.pids()
    try:
        tokens: list[int] = []

        async def end(record) -> None:
            assert record.finished

        async with rt.request("r1", end) as scope:
            await rt.admit(scope, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            while not scope.finished:
                out = await asyncio.wait_for(scope.next_output(), 60)
                tokens += out.new_token_ids
                scope.finished = out.finished
        assert len(tokens) == 4
        os.kill(pid, signal.SIGKILL)  # idle node: noticed by the engine loop's rank check
        await asyncio.wait_for(rt.failed.wait(), 15)
        status = None
        for _ in range(50):
            status = await rt.health.Check(health_pb2.HealthCheckRequest(), None)
            if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        assert status is not None and status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await rt.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_tensor_parallel_prefill_node_needs_a_network_transport(tiny_model_dir):
    from pdserve.node_runtime.node_config import TransferOptions
    from pdserve.prefill_node.server import PrefillNode

    config = NodeConfig(
        EngineConfig(tiny_model_dir, num_kv_blocks=64, tensor_parallel_size=2), transfer=TransferOptions("local")
    )
    with pytest.raises(ValueError, match="needs a network transport"):
        PrefillNode(config)


async def test_a_hung_rank_fails_the_node_within_the_dist_timeout(tiny_model_dir):
    """A rank that stops answering (SIGSTOP: alive, so no death is seen) breaks rank 0's next
    collective after --dist-timeout: the request ends with an error, the node reports NOT_SERVING and
    fails (its supervisor restarts it), and the hung rank is killed, not left behind."""
    config = EngineConfig(tiny_model_dir, num_kv_blocks=64, tensor_parallel_size=2, dist_timeout=2.0)
    rt = NodeRuntime("decode", NodeConfig(config))
    await rt.start(lambda server: None)
    (pid,) = rt.engine.runner.ranks.pids()

    async def end(record) -> None:
        assert not record.finished

    try:
        os.kill(pid, signal.SIGSTOP)
        async with rt.request("r1", end) as scope:
            await rt.admit(scope, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            with pytest.raises(EngineDeadError):  # well before the 120 s default would have passed
                while not (await asyncio.wait_for(scope.next_output(), 60)).finished:
                    pass
        await asyncio.wait_for(rt.failed.wait(), 15)
        assert isinstance(rt.loop_thread.error, RankFailure)
        status = await rt.health.Check(health_pb2.HealthCheckRequest(), None)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await rt.stop()
    for _ in range(100):  # reaped by the runner's stop
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the hung rank outlived its node")
