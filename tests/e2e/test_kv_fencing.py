"""A prefill node that stalls mid-payload must never corrupt the next request on the same blocks,
and a client that cancels during the stall must leave no block and no in-flight request behind
(issue 13, bugs 1 and 2). The decode node runs as a real process with a pool so small that the next
request must reuse the stalled request's blocks; a cancel during a stalled delta transfer (issue 22) keeps the
held prefix exact."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from tests.e2e.cluster import start_cluster
from tests.e2e.fake_prefill import StallingPrefill
from tests.e2e.grpc_client import generate, greedy, load

pytestmark = pytest.mark.e2e
KV_TIMEOUT = "5"
POOL_BLOCKS = 16  # block_size 16: the victim's 240-token prompt + 16 tokens need all 16 blocks


async def blocks_all_free(address: str, secret: str, within: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        report = await load(address, secret)
        if report.num_free_blocks == report.num_total_blocks:
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.1)


async def start_with_fake(tiny_model_dir, num_prefill: int):
    cluster = start_cluster(
        num_prefill,
        1,
        model=str(tiny_model_dir),
        extra=["--kv-timeout", KV_TIMEOUT],
        decode_extra=["--num-kv-blocks", str(POOL_BLOCKS), "--drain-timeout", "300"],
    )
    decode = cluster.decodes[0].address
    fake = StallingPrefill((await load(decode, cluster.secret)).compatibility, cluster.secret)
    return cluster, decode, fake, await fake.start()


async def test_stalled_writer_never_lands_in_the_next_request(tiny_model_dir):
    cluster, decode, fake, fake_address = await start_with_fake(tiny_model_dir, 1)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # 100 tokens: blocks 0..6 of a fresh pool
            await generate(
                decode, cluster.secret, "stalled", [5 + i for i in range(100)], greedy(4), [fake_address], timeout=120
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert fake.stalled.is_set()

        victim = [7 + (i * 13) % 1700 for i in range(240)]
        expected = (
            LLM(tiny_model_dir, num_kv_blocks=64)
            .generate([victim], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
            .outputs[0]
            .token_ids
        )
        tokens: list[int] = []
        async with grpc.aio.insecure_channel(decode) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.GenerateRequest(
                    request_id="victim",
                    prompt_token_ids=victim,
                    params=greedy(16, ignore_eos=True),
                    prefill_addresses=[cluster.prefills[0].address],
                ),
                metadata=cluster_metadata(cluster.secret),
                timeout=120,
            )
            async for event in call:
                if not tokens:  # the victim's KV is in the reused blocks: now the stalled host wakes up
                    fake.resume.set()
                    for t in fake.threads:
                        await asyncio.get_running_loop().run_in_executor(None, t.join, 60)
                tokens.extend(event.token_ids)
        assert tokens == expected
        assert fake.outcomes and "ok" not in fake.outcomes, fake.outcomes
        assert await blocks_all_free(decode, cluster.secret, within=30)
    finally:
        await fake.stop()
        cluster.stop()


async def test_cancel_during_stall_frees_blocks_and_drains(tiny_model_dir):
    cluster, decode, fake, fake_address = await start_with_fake(tiny_model_dir, 0)
    try:
        async with grpc.aio.insecure_channel(decode) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.GenerateRequest(
                    request_id="cancelled",
                    prompt_token_ids=[5 + i for i in range(100)],
                    params=greedy(4),
                    prefill_addresses=[fake_address],
                ),
                metadata=cluster_metadata(cluster.secret),
                timeout=120,
            )
            reader = asyncio.ensure_future(call.read())
            assert await asyncio.get_running_loop().run_in_executor(None, fake.stalled.wait, 60)
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        assert await blocks_all_free(decode, cluster.secret, within=30)
        # no in-flight request left behind: SIGTERM drains at once instead of waiting out --drain-timeout
        proc = cluster.decodes[0].popen
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
    finally:
        await fake.stop()
        cluster.stop()


async def test_cancel_during_a_stalled_delta_transfer_keeps_the_held_prefix_and_leaks_nothing(tiny_model_dir):
    """Reuse across the split: the decode node holds turn 1 (prefilled locally), so turn 2 shares
    those blocks and opens a session over the missing ones only. A client cancel while the writer
    stalls inside that session frees the fresh blocks; its late bytes land nowhere, and the held
    prefix is still exact: turn 2 served afterwards matches the engine run alone."""
    cluster, decode, fake, fake_address = await start_with_fake(tiny_model_dir, 0)
    turn1 = [5 + (i * 7) % 1600 for i in range(100)]
    try:
        answer, _ = await generate(decode, cluster.secret, "turn1", turn1, greedy(4, ignore_eos=True), [])
        turn2 = turn1 + answer + [9 + i for i in range(60)]  # 6 held blocks, 5 to fill remotely
        async with grpc.aio.insecure_channel(decode) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.GenerateRequest(
                    request_id="delta",
                    prompt_token_ids=turn2,
                    params=greedy(4, ignore_eos=True),
                    prefill_addresses=[fake_address],
                ),
                metadata=cluster_metadata(cluster.secret),
                timeout=120,
            )
            reader = asyncio.ensure_future(call.read())
            assert await asyncio.get_running_loop().run_in_executor(None, fake.stalled.wait, 60)
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        assert await blocks_all_free(decode, cluster.secret, within=30)
        fake.resume.set()  # the stalled writer wakes up after its session was fenced
        for t in fake.threads:
            await asyncio.get_running_loop().run_in_executor(None, t.join, 60)
        assert fake.outcomes and "ok" not in fake.outcomes, fake.outcomes

        expected = (
            LLM(tiny_model_dir, num_kv_blocks=64)
            .generate([turn2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
            .outputs[0]
            .token_ids
        )
        again, _ = await generate(decode, cluster.secret, "again", turn2, greedy(4, ignore_eos=True), [])
        assert again == expected
        assert await blocks_all_free(decode, cluster.secret, within=30)
    finally:
        await fake.stop()
        cluster.stop()
