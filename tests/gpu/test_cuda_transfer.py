"""CUDA-correct KV transfer: staging waits on the layer's event, and a one-GPU disaggregated cluster
(prefill and decode processes sharing the GPU, TCP with CUDA pools) equals engine.LLM."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.cachestore.staging import HostStaging
from pdserve.engine import LLM, SamplingParams
from tests.e2e.cluster import start_cluster
from tests.e2e.grpc_client import generate, greedy
from tests.e2e.test_nodes import all_free, mixed_prompts
from tests.gpu.helpers import CUDA_NODE_FLAGS, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_staging_read_waits_for_the_layer_event():
    """The copy runs on a side stream: without waiting on the event it would read the pool before the
    (deliberately slow) kernels on the engine's stream wrote it."""
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    staging = HostStaging(1 << 20)
    for value in (7, 9):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
        pool.fill_(value)
        event = torch.cuda.Event()
        event.record()
        host = staging.read(pool, 0, pool.numel(), event)
        assert bytes(host[:4]) == bytes([value]) * 4 and bytes(host[-4:]) == bytes([value]) * 4
    assert staging.allocations == 1


@pytest.fixture(scope="module")
def gpu_cluster(tiny_model_dir):
    c = start_cluster(
        1,
        2,
        model=str(tiny_model_dir),
        extra=CUDA_NODE_FLAGS,
    )
    try:
        yield c
    finally:
        c.stop()


async def test_one_gpu_cluster_over_tcp_equals_llm(gpu_cluster, tiny_model_dir):
    reference = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=1024)
    prompts = mixed_prompts(16, seed=11)
    expected = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    prefill = [gpu_cluster.prefills[0].address]
    results = await asyncio.gather(
        *[
            generate(
                gpu_cluster.decodes[i % 2].address,
                gpu_cluster.secret,
                f"g{i}",
                p,
                greedy(24, ignore_eos=True),
                prefill,
                timeout=120,
            )
            for i, p in enumerate(prompts)
        ]
    )
    for (tokens, _), exp in zip(results, expected):
        assert tokens == exp.outputs[0].token_ids
    await all_free(gpu_cluster, nominal=10.0)
