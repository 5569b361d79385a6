"""KV paths beyond prefill -> decode on mixture-of-experts models (tiny Qwen3-MoE, DeepSeek-V3,
gpt-oss): the D->P pull of a held prefix, and a stream migrated off a decode node killed mid-stream,
each with the text the engine gives alone."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tiny_model import make_tiny_model
from tests.e2e.cluster import stop
from tests.e2e.inproc import assert_no_blocks_used, in_process_nodes
from tests.e2e.router_cluster import start_full
from tests.e2e.test_failover import LONG, migrations, stream_text, streams_under_way
from tests.e2e.test_kv_pull import pulls, two_turns

pytestmark = pytest.mark.e2e


@pytest.fixture(
    scope="module",
    params=[
        "qwen3-moe",
        pytest.param("deepseek-v3", marks=pytest.mark.slow),
        pytest.param("gpt-oss", marks=pytest.mark.slow),
    ],
    ids=lambda a: a,
)
def moe_dir(tmp_path_factory, request):
    """Qwen3-MoE, DeepSeek-V3 (latent KV: one plane of one "head", pulled and migrated whole), and
    gpt-oss (the KV of windowed and full layers alike, pulled and migrated whole)."""
    return make_tiny_model(tmp_path_factory.mktemp("moe"), "tiny", arch=request.param)


async def test_a_held_prefix_is_pulled_into_the_prefill_node(moe_dir):
    async with in_process_nodes(moe_dir, num_prefill=2, pull_min=1) as nodes:
        tokens, events, turn2 = await two_turns(nodes, "moe", max_tokens=12)
        assert pulls(nodes, "pulled") == 1 and events[-1].usage.cached_tokens == 96
        expected = LLM(moe_dir, num_kv_blocks=64).generate(
            [turn2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        )
        assert tokens == expected[0].outputs[0].token_ids
        await assert_no_blocks_used(nodes)


@pytest.mark.slow
async def test_a_stream_migrates_off_a_killed_decode_node(moe_dir):
    cluster, router, base = start_full(str(moe_dir), num_prefill=1, num_decode=2)
    try:
        prompts = [f"Story number {i}: the river" for i in range(12)]
        async with httpx.AsyncClient() as client:
            reference = await asyncio.gather(*[stream_text(client, base, p, LONG) for p in prompts])
            tasks, victim = await streams_under_way(client, base, cluster, prompts, reference)
            stop(cluster.decodes[victim], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        assert results == reference
        assert migrations(base) >= 1, "no stream was migrated: the kill came too late"
    finally:
        stop(router)
        cluster.stop()
