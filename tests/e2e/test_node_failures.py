"""Failure handling with real processes: a prefill node killed mid-transfer, retry on another prefill
node, SIGTERM drain, and the in-process cluster over the `local` transport."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.node_runtime.node_config import NodeConfig, NodeOptions, TransferOptions
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from tests.e2e.cluster import start_cluster, stop
from tests.e2e.deadlines import until
from tests.e2e.grpc_client import generate, greedy, load

pytestmark = pytest.mark.e2e


async def test_prefill_killed_mid_transfer_leaves_no_blocks(tiny_model_dir):
    # every layer write waits 0.3 s in the prefill node's sender, so the kill lands inside the transfer
    # however fast the prompt computes (a fast engine had finished it between the probe and the kill)
    slow_writes = {"PDSERVE_FAULT_WRITE_DELAY_RATE": "1", "PDSERVE_FAULT_WRITE_DELAY_SECONDS": "0.3"}
    cluster = start_cluster(2, 1, model=str(tiny_model_dir), extra=["--kv-timeout", "10"], env=slow_writes)
    try:
        dead, alive = cluster.prefills
        decode = cluster.decodes[0].address
        long_prompt = [5 + i % 1500 for i in range(3500)]

        async def decode_free() -> bool:
            r = await load(decode, cluster.secret)
            return r.num_free_blocks == r.num_total_blocks

        task = asyncio.create_task(
            generate(decode, cluster.secret, "victim", long_prompt, greedy(4), [dead.address], timeout=30)
        )

        async def computing() -> bool:  # the prefill node holds the prompt's blocks: kill it now
            try:
                r = await load(dead.address, cluster.secret, "prefill", timeout=0.5)
            except grpc.aio.AioRpcError as e:  # load waits for the engine's step: no answer = mid-step
                return e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return r.num_free_blocks < r.num_total_blocks

        assert await until(computing, nominal=2.0, interval=0.01)
        stop(dead, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await task
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await until(decode_free, nominal=1.0)
        # a request naming a dead node first is retried on the next prefill node
        tokens, events = await generate(
            decode, cluster.secret, "retry", [5, 6, 7, 8], greedy(5), [dead.address, alive.address]
        )
        assert len(tokens) == 5 and events[-1].finish_reason == "length"
        assert await until(decode_free, nominal=1.0)
    finally:
        cluster.stop()


async def test_sigterm_drains_then_exits_zero(tiny_model_dir):
    cluster = start_cluster(1, 1, model=str(tiny_model_dir))
    try:
        decode = cluster.decodes[0]
        async with grpc.aio.insecure_channel(decode.address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.GenerateRequest(
                    request_id="draining",
                    prompt_token_ids=[5, 6, 7],
                    params=greedy(60, ignore_eos=True),
                    prefill_addresses=[cluster.prefills[0].address],
                ),
                metadata=cluster_metadata(cluster.secret),
                timeout=120,
            )
            tokens = list((await call.read()).token_ids)  # in flight for sure: now SIGTERM
            decode.popen.send_signal(signal.SIGTERM)
            while (event := await call.read()) is not grpc.aio.EOF:  # it finishes during the drain
                tokens.extend(event.token_ids)
        assert len(tokens) == 60
        assert await asyncio.get_running_loop().run_in_executor(None, decode.popen.wait, 30) == 0
    finally:
        cluster.stop()


async def test_in_process_cluster_over_local_transport(tiny_model_dir):
    """Prefill and decode nodes in this process, KV copied by the in-process `local` transport."""
    from pdserve.decode_node import DecodeNode
    from pdserve.prefill_node import PrefillNode

    node, transfer = NodeOptions(cluster_secret="s"), TransferOptions(transport="local")
    prefill = PrefillNode(
        NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=256, max_num_batched_tokens=4096), node, transfer)
    )
    decode = DecodeNode(NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=256, preemption="never"), node, transfer))
    p_addr = await prefill.start()
    d_addr = await decode.start()
    try:
        prompts = [[5 + (i * 7 + j) % 1500 for j in range(10 + 9 * i)] for i in range(16)]
        ref = LLM(tiny_model_dir, num_kv_blocks=512).generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        )
        results = await asyncio.gather(
            *[generate(d_addr, "s", f"l{i}", p, greedy(12, ignore_eos=True), [p_addr]) for i, p in enumerate(prompts)]
        )
        assert [t for t, _ in results] == [r.outputs[0].token_ids for r in ref]
        assert decode.cachestore.num_sessions == 0
        for node_addr, role in ((d_addr, "decode"), (p_addr, "prefill")):
            report = await load(node_addr, "s", role)
            assert report.num_free_blocks == report.num_total_blocks
    finally:
        await decode.stop()
        await prefill.stop()


async def test_decode_health_follows_the_cachestore_listener(tiny_model_dir):
    """While the CacheStore listener cannot accept (tests/cachestore/test_listener.py makes a real EMFILE),
    the decode node's gRPC health says NOT_SERVING, and SERVING again once it accepts."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.decode_node import DecodeNode

    decode = DecodeNode(
        NodeConfig(
            EngineConfig(tiny_model_dir, num_kv_blocks=64, preemption="never"),
            NodeOptions(cluster_secret="s"),
            TransferOptions(transport="tcp"),
        )
    )
    address = await decode.start()
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status_is(expected):
                async def check() -> bool:
                    return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == expected

                return check

            assert await until(status_is(health_pb2.HealthCheckResponse.SERVING), nominal=1.0)
            decode.cachestore._listener._set_up(False)  # what an accept() failure does
            assert await until(status_is(health_pb2.HealthCheckResponse.NOT_SERVING), nominal=1.0)
            decode.cachestore._listener._set_up(True)  # what the next successful accept does
            assert await until(status_is(health_pb2.HealthCheckResponse.SERVING), nominal=1.0)
    finally:
        await decode.stop()
