"""Reuse across the prefill/decode split, on in-process nodes: only missing blocks move, outputs
match the no-reuse path, local prefill when it pays, and no phase leaks a block."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.e2e.grpc_client import generate, greedy
from tests.e2e.inproc import SECRET, Nodes, assert_no_blocks_used, in_process_nodes

pytestmark = pytest.mark.e2e
BS = 16  # EngineConfig's default block size
TURN1 = [5 + (i * 11) % 1500 for i in range(100)]
NEW = [7 + (i * 13) % 1500 for i in range(40)]


def counter(node, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on the node's registry whose labels include `labels`."""
    total = 0.0
    for metric in node.rt.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def received_blocks(nodes: Nodes) -> float:
    pool = nodes.decode.rt.engine.runner.kv_pool
    return counter(nodes.decode, "pdserve_cachestore_bytes_total", side="recv") / (pool.num_layers * pool.block_bytes)


async def chat(
    nodes: Nodes, name: str, turns: int, prefill: list[str] | None = None, first: list[int] = TURN1
) -> tuple[list, list]:
    """A `turns`-turn conversation: each prompt is the previous prompt, its answer and new tokens.
    Returns (answers, prompts)."""
    prompt, answers, prompts = list(first), [], []
    for t in range(turns):
        tokens, _ = await generate(
            nodes.decode_address,
            SECRET,
            f"{name}-{t}",
            prompt,
            greedy(12, ignore_eos=True),
            nodes.prefill_addresses if prefill is None else prefill,
        )
        answers.append(tokens)
        prompts.append(prompt)
        prompt = prompt + tokens + NEW[: 20 + 10 * t]
    return answers, prompts


async def test_delta_transfer_lands_exactly_the_missing_blocks(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir, local_max=0) as nodes:
        first, events = await generate(
            nodes.decode_address, SECRET, "t1", TURN1, greedy(12, ignore_eos=True), nodes.prefill_addresses
        )
        assert received_blocks(nodes) == 7 and events[-1].usage.cached_tokens == 0
        turn2 = TURN1 + first + NEW  # 152 tokens, 10 blocks
        held = (len(TURN1) + len(first) - 1) // BS  # decode computed all but the last sampled token: 6 blocks
        cached_blocks = set(nodes.decode.rt.engine.block_manager.hash_to_block.values())
        sessions: list[list[int]] = []
        open_session = nodes.decode.cachestore.open_session

        def recording(rid, block_ids, *args, **kwargs):
            sessions.append(list(block_ids))
            return open_session(rid, block_ids, *args, **kwargs)

        nodes.decode.cachestore.open_session = recording
        tokens, events = await generate(
            nodes.decode_address, SECRET, "t2", turn2, greedy(8, ignore_eos=True), nodes.prefill_addresses
        )
        assert received_blocks(nodes) == 7 + (10 - held)
        # only fresh blocks are ever writable: no late write can land in a shared, cached block
        assert len(sessions) == 1 and len(sessions[0]) == 10 - held and not set(sessions[0]) & cached_blocks
        # the prefill node's own cache held turn 1's 6 full blocks: tokens not recomputed anywhere
        assert events[-1].usage.cached_tokens == 96
        expected = LLM(tiny_model_dir, num_kv_blocks=64).generate(
            [turn2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        assert tokens == expected[0].outputs[0].token_ids
        assert counter(nodes.decode, "pdserve_prefill_decisions_total", location="remote") == 2
        await assert_no_blocks_used(nodes)


async def test_reuse_on_and_off_give_identical_greedy_outputs(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir, reuse=False) as off:
        baseline, prompts = await chat(off, "off", 3)
        assert received_blocks(off) == sum(-(-len(p) // BS) for p in prompts)  # every block, every turn
    async with in_process_nodes(tiny_model_dir, local_max=64) as on:
        assert (await chat(on, "on", 3))[0] == baseline
        assert counter(on.decode, "pdserve_prefill_decisions_total", location="local") >= 1
        await assert_no_blocks_used(on)


async def test_local_prefill_without_prefill_nodes_and_when_all_fail(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir, num_prefill=0, local_max=8) as nodes:
        reference, _ = await chat(nodes, "none", 2)  # no prefill address: prefilled on the decode node
        assert counter(nodes.decode, "pdserve_prefill_decisions_total", location="local") == 2
        # every named prefill node is unreachable: the decode node prefills it after all
        other = [3 + t for t in TURN1]  # nothing of it cached: each turn lacks far more than 8 tokens
        fallback, _ = await chat(nodes, "dead", 2, prefill=["127.0.0.1:1"], first=other)
        assert (await chat(nodes, "again", 2, first=other))[0] == fallback
        assert counter(nodes.decode, "pdserve_prefill_decisions_total", location="remote") == 0
        assert counter(nodes.decode, "pdserve_prefill_decisions_total", location="local") == 6
        await assert_no_blocks_used(nodes)


@pytest.mark.parametrize("local_max", [0, 4096])  # remote (delta transfer) and local prefill
async def test_cancel_in_every_phase_leaves_no_block(tiny_model_dir, local_max):
    long_turn = [5 + (i * 7) % 1500 for i in range(1500)]
    async with in_process_nodes(tiny_model_dir, local_max=local_max) as nodes:
        first, _ = await generate(
            nodes.decode_address, SECRET, "warm", long_turn, greedy(4, ignore_eos=True), nodes.prefill_addresses
        )
        turn2 = long_turn + first + [9 + i % 1400 for i in range(1200)]
        for i, delay in enumerate((0.0, 0.02, 0.1, 0.3, 0.8)):  # cut at different phases of the same request
            call = asyncio.ensure_future(
                generate(nodes.decode_address, SECRET, f"cut{i}", turn2, greedy(4), nodes.prefill_addresses)
            )
            await asyncio.sleep(delay)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            for _ in range(100):  # the nodes finish their cleanup just after the stream ends
                if not any(n.rt.inflight for n in nodes.all()):
                    break
                await asyncio.sleep(0.05)
            await assert_no_blocks_used(nodes)


async def test_bad_cache_salt_and_held_length_are_refused_and_salts_never_share(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir, local_max=0) as nodes:
        async with grpc.aio.insecure_channel(nodes.prefill_addresses[0]) as ch:
            for held in (5, 112):  # not block aligned; not below the prompt length
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                        prefill_pb2.PrefillRequest(
                            request_id="p",
                            prompt_token_ids=TURN1[:112],
                            params=greedy(2),
                            compatibility=nodes.decode.rt.compatibility,
                            decode_cached_tokens=held,
                        ),
                        metadata=cluster_metadata(SECRET),
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decode_cached_tokens" in str(
                    err.value.details()
                )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(
                nodes.decode_address, SECRET, "x", TURN1, greedy(2), nodes.prefill_addresses, cache_salt="s" * 257
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for rid, salt in (("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a")):
            _, events = await generate(
                nodes.decode_address, SECRET, rid, TURN1 + NEW, greedy(2), nodes.prefill_addresses, cache_salt=salt
            )
            assert events[-1].usage.cached_tokens == (128 if rid == "a2" else 0), rid
        await assert_no_blocks_used(nodes)
