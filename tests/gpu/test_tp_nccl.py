"""Tensor parallelism over NCCL: collectives bounded by --dist-timeout and timed by CUDA events
(`TPGroup.synchronize`), and a hung rank turned into a node failure as on gloo. One GPU runs a
group of one (real NCCL, real events); the two-GPU tests skip where only one card is lent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.group import RankFailure, TPGroup, rendezvous
from pdserve.engine.sampling_params import SamplingParams
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one rank per GPU: needs two GPUs")


def test_a_group_of_one_over_nccl_times_its_collectives_with_events() -> None:
    group = TPGroup(0, 1, rendezvous(0, 1, 0, 60), torch.device("cuda:0"), timeout_s=30)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in os.environ  # set before the group was built (unless the user had)
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    for _ in range(3):
        group.all_reduce(t)
    group.synchronize()
    assert torch.equal(t.cpu(), torch.arange(1 << 20, dtype=torch.float32))  # one rank: the sum is itself
    assert group.all_reduce_seconds > 0 and not group._events


@two_gpus
def test_two_ranks_over_nccl_equal_one(tiny_model_dir) -> None:
    from pdserve.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i for i in range(n)] for n in (7, 40, 130)]
    outs = {}
    for tp in (1, 2):
        llm = LLM(tiny_model_dir, device="cuda", dtype="float32", tensor_parallel_size=tp)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outs[1] == outs[2]


@two_gpus
async def test_a_hung_nccl_rank_fails_the_node_within_the_dist_timeout(tiny_model_dir) -> None:
    from grpc_health.v1 import health_pb2

    from pdserve.node_runtime.engine_loop import EngineDeadError
    from pdserve.node_runtime.node import NodeRuntime
    from pdserve.node_runtime.node_config import NodeConfig

    config = EngineConfig(
        tiny_model_dir, device="cuda", dtype="float32", tensor_parallel_size=2, dist_timeout=3.0, num_kv_blocks=64
    )
    rt = NodeRuntime("decode", NodeConfig(config))
    await rt.start(lambda server: None)
    (pid,) = rt.engine.runner.ranks.pids()

    async def end(record) -> None:
        assert not record.finished

    try:
        os.kill(pid, signal.SIGSTOP)
        async with rt.request("r1", end) as scope:
            await rt.admit(scope, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            with pytest.raises(EngineDeadError):
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
