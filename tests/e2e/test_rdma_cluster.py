"""A disaggregated cluster over `--transport rdma` on the emulated verbs device: the prefill and the
decode node are separate processes, so every KV WRITE crosses the emulated wire (a loopback socket
from the prefill node's QPs to the decode node's device endpoint) and is checked by the decode
process's responder. EMULATED: proves the rdma transport's logic across processes, not a NIC."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.cluster import start_cluster
from tests.e2e.grpc_client import generate, greedy, load
from tests.e2e.test_nodes import mixed_prompts

pytestmark = pytest.mark.e2e


async def test_rdma_cluster_on_the_emulated_device_equals_llm(tiny_model_dir):
    prompts = mixed_prompts(4, seed=11)
    expected = LLM(tiny_model_dir, num_kv_blocks=256).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    cluster = start_cluster(1, 1, transport="rdma", model=str(tiny_model_dir), env={"PDSERVE_RDMA_EMULATOR": "1"})
    try:
        decode, prefill = cluster.decodes[0].address, cluster.prefills[0].address
        results = await asyncio.gather(
            *[
                generate(decode, cluster.secret, f"rdma-{i}", p, greedy(12, ignore_eos=True), [prefill], timeout=120)
                for i, p in enumerate(prompts)
            ]
        )
        for (tokens, events), exp in zip(results, expected):
            assert tokens == exp.outputs[0].token_ids
            assert events[-1].finish_reason == "length"
        report = await load(decode, cluster.secret)
        for _ in range(100):  # blocks are freed once each session's grants are revoked (bounded poll)
            if report.num_free_blocks == report.num_total_blocks:
                break
            await asyncio.sleep(0.1)
            report = await load(decode, cluster.secret)
        assert report.num_free_blocks == report.num_total_blocks
    finally:
        cluster.stop()
    logs = "\n".join(cluster.decodes[0].lines + cluster.prefills[0].lines)
    assert "transport=rdma" in logs, logs[-3000:]
