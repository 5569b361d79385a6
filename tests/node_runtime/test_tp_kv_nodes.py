"""Prefill and decode nodes of different TP degrees in this process (their other ranks are child
processes, so KV moves over tcp): greedy tokens equal one rank's, an abort leaves no block, session or
transfer behind on any rank, and a destination whose KV heads cannot map is refused."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from pdserve.cachestore import SessionCredentials
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime.node_config import NodeConfig, NodeOptions, TransferOptions
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.e2e.grpc_client import generate, greedy

pytestmark = pytest.mark.slow
SECRET = "s"
PROMPT = list(range(5, 45))


def _config(model_dir, tp: int, transport: str, **engine) -> NodeConfig:
    node = NodeOptions(cluster_secret=SECRET, local_prefill_max_tokens=0)
    return NodeConfig(
        EngineConfig(model_dir, num_kv_blocks=64, tensor_parallel_size=tp, **engine), node, TransferOptions(transport)
    )


async def _no_leaks(prefill, decode) -> None:
    for node in (prefill, decode):
        engine = node.rt.engine
        await node.rt.loop_thread.call(engine.check_integrity)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, node.rt.role
        assert not engine.requests
    assert decode.cachestore.num_sessions == 0 and not prefill.rt.requests
    assert all(s["sessions"] == 0 for s in await decode.ranks.stats())
    assert all(s["transfers"] == 0 for s in await prefill.ranks.stats())


@pytest.mark.parametrize("p_tp,d_tp,transport", [(2, 1, "tcp"), (1, 2, "tcp"), (2, 1, "rdma")])
async def test_tp_mismatch_tokens_aborts_and_refusals(tiny_model_dir, p_tp, d_tp, transport, monkeypatch):
    from pdserve.cachestore import rdma
    from pdserve.decode_node import DecodeNode
    from pdserve.prefill_node import PrefillNode

    if transport == "rdma":  # the emulated verbs device, across the ranks' processes too
        monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    want = LLM(tiny_model_dir, num_kv_blocks=64).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
    prefill = PrefillNode(_config(tiny_model_dir, p_tp, transport))
    decode = DecodeNode(_config(tiny_model_dir, d_tp, transport, preemption="never"))
    p_addr = await prefill.start()
    d_addr = await decode.start()
    try:
        tokens, _ = await generate(d_addr, SECRET, "r1", PROMPT, greedy(8), [p_addr])
        assert tokens == want[0].outputs[0].token_ids
        await _no_leaks(prefill, decode)

        # a client that goes away mid-stream: every rank of both nodes lets go of the request
        async with grpc.aio.insecure_channel(d_addr) as channel:
            request = decode_pb2.GenerateRequest(
                request_id="r2",
                prompt_token_ids=PROMPT,
                params=greedy(500, ignore_eos=True),
                prefill_addresses=[p_addr],
            )
            call = decode_pb2_grpc.DecodeStub(channel).Generate(request, metadata=cluster_metadata(SECRET))
            assert (await call.read()).token_ids  # the prompt's KV came over; decoding has begun
            call.cancel()
        for _ in range(100):
            if not decode.rt.engine.requests and not prefill.rt.engine.requests:
                break
            await asyncio.sleep(0.1)
        await _no_leaks(prefill, decode)

        # a destination from a model with other KV heads cannot map: refused before anything runs
        creds = decode.cachestore.open_session("forged", [0, 1, 2], timeout=5)
        forged = dataclasses.replace(creds, total_heads=4 * creds.total_heads, tp_size=1, tp_rank=0)
        request = prefill_pb2.PrefillRequest(
            request_id="forged",
            prompt_token_ids=PROMPT,
            params=greedy(1),
            kv_destination=forged.to_bytes(),
            compatibility=prefill.rt.compatibility,
        )
        async with grpc.aio.insecure_channel(p_addr) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, metadata=cluster_metadata(SECRET))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "KV heads" in (err.value.details() or "")
        decode.cachestore.close_session("forged")
        assert SessionCredentials.from_bytes(creds.to_bytes()).tp_size == d_tp
    finally:
        await decode.stop()
        await prefill.stop()
