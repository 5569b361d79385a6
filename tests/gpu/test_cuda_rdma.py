"""The rdma transport with CUDA pools, on the emulated verbs device: the emulator has no
peer-memory client, so both sides take pinned-host staging (`cachestore.rdma_memory`); GPUDirect
itself needs an RDMA NIC and is NOT EXERCISED here."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials, rdma
from pdserve.cachestore import rdma_memory
from pdserve.engine import LLM, SamplingParams
from tests.e2e.cluster import start_cluster
from tests.e2e.grpc_client import generate, greedy
from tests.e2e.test_nodes import mixed_prompts
from tests.gpu.helpers import CUDA_NODE_FLAGS, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
GEO = PoolGeometry(num_layers=4, num_blocks=32, block_bytes=64 << 10)


async def test_cuda_pools_are_staged_after_each_layers_event(monkeypatch):
    """Each layer's blocks are written by slow kernels on the default stream, then its event is
    recorded: the lane's device-to-host copy must wait for it, or it would send stale bytes."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    src = torch.zeros(GEO.total_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.full((GEO.total_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
    server = CacheStoreServer(MemoryRegion.from_tensor(dst), GEO, transport="rdma", secret=b"s")
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_tensor(src), GEO, transport="rdma", secret=b"s")
    blocks, dst_blocks = [2, 3, 4, 10], [20, 21, 22, 5]
    try:
        assert server._rdma.staged and server._rdma.res.registration.staging.is_pinned()
        creds = server.open_session("g", dst_blocks, GEO.num_layers, timeout=60)
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))

        def engine() -> None:
            for layer in range(GEO.num_layers):
                torch.cuda._sleep(20_000_000)  # the layer's "kernels" take a while
                for b in blocks:
                    start = GEO.offset(layer, b)
                    src[start : start + GEO.block_bytes].fill_(layer * 16 + b)
                event = torch.cuda.Event()
                event.record()
                tx.write_layer(layer, blocks, event)

        t = threading.Thread(target=engine, name="engine-thread")
        t.start()
        t.join(60)
        await tx.finish(60)
        session = server.get_session("g")
        server.close_session("g")
        await session.wait_safe_to_reuse(10)
        torch.cuda.synchronize()
        for layer in range(GEO.num_layers):
            for s, d in zip(blocks, dst_blocks):
                start = GEO.offset(layer, d)
                got = dst[start : start + GEO.block_bytes]
                assert bool((got == layer * 16 + s).all()), (layer, s, d)
        reg = tx._channel._res.registration
        assert reg.mode == rdma_memory.STAGING and reg.staging.is_pinned()
        assert "engine-thread" not in tx._channel.poll_threads
    finally:
        await client.close()
        await server.stop()


async def test_one_gpu_cluster_over_emulated_rdma_equals_llm(tiny_model_dir):
    reference = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=1024)
    prompts = mixed_prompts(6, seed=13)
    expected = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    cluster = start_cluster(
        1,
        1,
        transport="rdma",
        model=str(tiny_model_dir),
        env={"PDSERVE_RDMA_EMULATOR": "1"},
        extra=CUDA_NODE_FLAGS,
    )
    try:
        results = await asyncio.gather(
            *[
                generate(
                    cluster.decodes[0].address,
                    cluster.secret,
                    f"gr{i}",
                    p,
                    greedy(16, ignore_eos=True),
                    [cluster.prefills[0].address],
                    timeout=120,
                )
                for i, p in enumerate(prompts)
            ]
        )
        for (tokens, _), exp in zip(results, expected):
            assert tokens == exp.outputs[0].token_ids
    finally:
        cluster.stop()
    logs = "\n".join(cluster.decodes[0].lines + cluster.prefills[0].lines)
    assert "registers staging memory" in logs, logs[-3000:]


@pytest.mark.parametrize("heads,a,b", [(4, 1, 2), (4, 2, 1)])
async def test_cuda_pools_send_head_slices_over_staged_rdma(heads, a, b, monkeypatch):
    """P TP=a -> D TP=b with CUDA pools over the emulated device (staged both ways): each block's K
    and V slices of the receiving rank's heads are gathered into the sender's slot, bit-exact."""
    from tests.cachestore.test_head_slices import BLOCKS, _close, _move

    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    src_blocks, dst_blocks = [1, 2, 3, 7], [9, 10, 4, 0]
    full, dst_pools, servers, receivers = await _move(heads, a, b, "rdma", src_blocks, dst_blocks, device="cuda")
    try:
        for pool, server, r in zip(dst_pools, servers, receivers):
            assert server._rdma.staged
            await server.get_session("r").wait_complete(10)
            torch.cuda.synchronize()
            assert torch.equal(pool[:, dst_blocks], full[:, src_blocks][:, :, :, r.first : r.stop])
            assert not pool[:, [x for x in range(BLOCKS) if x not in dst_blocks]].any()
    finally:
        await _close(servers)
