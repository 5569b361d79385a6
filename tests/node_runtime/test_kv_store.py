"""A node's CacheStore ends (`node_runtime.kv_store`): which transport a prefill node receives pulls over."""

from __future__ import annotations

import asyncio
import types

import torch

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials, rdma
from pdserve.cachestore.transport import resolve_transport
from pdserve.node_runtime import kv_store
from tests.cachestore.helpers import SECRET
from tests.cachestore.test_rdma_emulated import _from_engine_thread


def _node(pool: torch.Tensor):
    return types.SimpleNamespace(engine=types.SimpleNamespace(kv_pool=types.SimpleNamespace(tensor=pool)))


def test_pulls_into_a_staged_cuda_pool_go_over_tcp(monkeypatch):
    """An rdma receiver of a CUDA pool without GPUDirect mirrors the whole pool in pinned host
    memory; the prefill node's pull receiver takes TCP there, and its own transport elsewhere."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")  # the emulated device has no peer-memory client
    pool = torch.zeros(4096, dtype=torch.uint8)
    assert kv_store.pull_transport(_node(pool), "rdma") == "rdma"  # a host pool registers in place
    assert kv_store.pull_transport(_node(pool), "tcp") == "tcp"
    device = MemoryRegion(memoryview(bytearray(0)), pool, is_device=True)
    monkeypatch.setattr(kv_store.MemoryRegion, "from_tensor", staticmethod(lambda tensor: device))
    assert kv_store.pull_transport(_node(pool), "rdma") == "tcp"
    assert kv_store.pull_transport(_node(pool), resolve_transport("auto")) == "tcp"  # auto: rdma, a device exists
    assert kv_store.pull_transport(_node(pool), "local") == "local"


async def test_an_rdma_sender_writes_into_a_tcp_receiver(monkeypatch):
    """The decode node's sender is built for rdma; the pull's credentials name tcp, and it follows them."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    geo = PoolGeometry(num_layers=2, num_blocks=8, block_bytes=256)
    src = torch.randint(0, 256, (geo.total_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros(geo.total_bytes, dtype=torch.uint8)
    server = CacheStoreServer(MemoryRegion.from_tensor(dst), geo, transport="tcp", secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_tensor(src), geo, transport="rdma", secret=SECRET)
    try:
        creds = server.open_session("pull", [5, 6], geo.num_layers, timeout=30)
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
        _from_engine_thread(lambda: [tx.write_layer(layer, [1, 2]) for layer in range(geo.num_layers)])
        await asyncio.wait_for(tx.finish(20), 30)
        session = server.get_session("pull")
        server.close_session("pull")
        await session.wait_safe_to_reuse(10)
        for layer in range(geo.num_layers):
            for s, d in zip([1, 2], [5, 6]):
                a, b = geo.offset(layer, s), geo.offset(layer, d)
                assert torch.equal(dst[b : b + geo.block_bytes], src[a : a + geo.block_bytes])
    finally:
        await client.close()
        await server.stop()


async def test_each_node_says_its_tcp_fallback_once(tiny_model_dir, caplog):
    """`auto` without an RDMA device falls back to TCP loudly, once per node: a node's second CacheStore
    end (the prefill node's pull receiver, the decode node's pull sender) takes the first one's
    resolved transport instead of resolving `auto` again."""
    from tests.e2e.inproc import in_process_nodes

    with caplog.at_level("WARNING", logger="pdserve.cachestore"):
        async with in_process_nodes(tiny_model_dir, transport="auto"):
            pass
    said = [r for r in caplog.records if "falling back to tcp" in r.getMessage()]
    assert len(said) == 2, [r.getMessage() for r in said]  # one prefill node and one decode node
