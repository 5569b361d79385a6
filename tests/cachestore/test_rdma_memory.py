"""GPUDirect vs pinned-host staging for the rdma transport (`cachestore.rdma_memory`).

The choice logic runs on CPU with a pool that reports itself as device memory, as the TCP staging
tests do; the staged transfer runs end to end on the emulated verbs device (which has no
peer-memory client, so a device pool is always staged there). NOT EXERCISED on hardware: neither
GPUDirect nor pinned staging has run on a GPU with an RDMA NIC.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    MemoryRegion,
    PoolGeometry,
    SessionCredentials,
    rdma,
    rdma_memory,
)
from pdserve.cachestore.staging import HostStaging
from pdserve.cachestore.verbs_emu import FABRIC
from tests.cachestore.helpers import SECRET
from tests.cachestore.test_rdma_emulated import _from_engine_thread

GEO = PoolGeometry(num_layers=3, num_blocks=16, block_bytes=512)


def device_like(tensor: torch.Tensor) -> MemoryRegion:
    return MemoryRegion(memoryview(bytearray(0)), tensor, is_device=True)


class FakeVerbs:
    """A verbs provider whose MR registration of device memory succeeds or fails on demand."""

    def __init__(self, accept_device: bool, device_address: int = -1) -> None:
        self.accept_device, self.device_address = accept_device, device_address
        self.registered: list[int] = []

    def MR(self, pd, length, access, address):  # noqa: N802 (pyverbs' name)
        if not self.accept_device and address == self.device_address:
            raise OSError("ibv_reg_mr: Bad address (no peer-memory client)")
        self.registered.append(address)
        return types.SimpleNamespace(lkey=1, rkey=2, close=lambda: None)


def test_choice_host_pool_gpudirect_and_staging(monkeypatch):
    host = MemoryRegion.from_buffer(bytearray(4096))
    assert rdma_memory.choose(FakeVerbs(True), host)[0] == rdma_memory.HOST
    pool = torch.zeros(4096, dtype=torch.uint8)
    region = device_like(pool)
    # the emulated device never takes GPUDirect
    import pdserve.cachestore.verbs_emu as emulated

    mode, reason = rdma_memory.choose(emulated, region)
    assert mode == rdma_memory.STAGING and "emulated" in reason
    # a peer-memory client present: GPUDirect if registering the pool succeeds, else staging
    monkeypatch.setattr(rdma_memory, "PEER_MEMORY_PATHS", ("/",))
    v = FakeVerbs(accept_device=True, device_address=pool.data_ptr())
    reg = rdma_memory.register(v, None, region, 1, lanes=2, block_bytes=512)
    assert reg.mode == rdma_memory.GPUDIRECT and reg.address == pool.data_ptr() and reg.staging is None
    v = FakeVerbs(accept_device=False, device_address=pool.data_ptr())
    reg = rdma_memory.register(v, None, region, 1, lanes=2, block_bytes=512)
    assert reg.mode == rdma_memory.STAGING and "failed" in reg.reason
    assert reg.slot_bytes == 4096 and reg.staging.numel() == 2 * 4096  # one slot per lane, capped at the pool
    assert v.registered == [reg.address]  # only the staging buffer is registered
    # no peer-memory client, or forced off: staging without trying
    monkeypatch.setattr(rdma_memory, "PEER_MEMORY_PATHS", ("/nonexistent/peermem",))
    assert rdma_memory.choose(v, region)[0] == rdma_memory.STAGING
    monkeypatch.setattr(rdma_memory, "PEER_MEMORY_PATHS", ("/",))
    monkeypatch.setenv(rdma_memory.GPUDIRECT_ENV, "off")
    assert rdma_memory.choose(v, region) == (rdma_memory.STAGING, f"${rdma_memory.GPUDIRECT_ENV}=off")


async def test_device_pools_are_staged_through_registered_host_buffers_bit_exact(monkeypatch):
    """Both pools "on the device": the sender copies each run into its lane's registered slot (one
    allocation, reused; runs larger than the slot go in pieces), the receiver's WRITEs land in its
    registered host mirror and each NOTIFY copies them into the pool before the ack."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    monkeypatch.setenv(rdma_memory.STAGING_ENV, str(2 * GEO.block_bytes))  # a 3-block run needs 2 pieces
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (GEO.total_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.full((GEO.total_bytes,), 0xA5, dtype=torch.uint8)
    server = CacheStoreServer(device_like(dst), GEO, transport="rdma", secret=SECRET)
    await server.start()
    client = CacheStoreClient(device_like(src), GEO, transport="rdma", secret=SECRET)
    gathers: list[str] = []
    gather = HostStaging.gather

    def recording_gather(self, *a, **kw):
        gathers.append(threading.current_thread().name)
        return gather(self, *a, **kw)

    monkeypatch.setattr(HostStaging, "gather", recording_gather)
    try:
        assert server._rdma.staged and server._rdma.remote_base != dst.data_ptr()
        for rid, src_blocks, dst_blocks in [("a", [1, 2, 3, 9], [4, 5, 6, 0]), ("b", [7], [12])]:
            creds = server.open_session(rid, dst_blocks, GEO.num_layers, timeout=30)
            tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
            _from_engine_thread(lambda: [tx.write_layer(layer, src_blocks) for layer in range(GEO.num_layers)])
            await tx.finish(20)
            session = server.get_session(rid)
            server.close_session(rid)
            await session.wait_safe_to_reuse(10)
            for layer in range(GEO.num_layers):
                for s, d in zip(src_blocks, dst_blocks):
                    a, b = GEO.offset(layer, s), GEO.offset(layer, d)
                    assert torch.equal(dst[b : b + GEO.block_bytes], src[a : a + GEO.block_bytes]), (rid, layer, s, d)
        channel = tx._channel
        reg = channel._res.registration
        assert reg.mode == rdma_memory.STAGING and reg.slot_bytes == 2 * GEO.block_bytes
        # never re-allocated
        assert all(lane._staging is None or lane._staging.allocations == 0 for lane in channel.lanes)
        assert gathers and all(name.startswith("cachestore-rdma-") for name in gathers)  # never the engine thread
        text = "\n".join(f"{m.name} {s.labels} {s.value}" for m in client.metrics.registry.collect() for s in m.samples)
        assert "'mode': 'staging'} 1.0" in text and "'mode': 'gpudirect'} 0.0" in text
        text = "\n".join(f"{m.name} {s.labels} {s.value}" for m in server.metrics.registry.collect() for s in m.samples)
        assert "'mode': 'staging'} 1.0" in text
    finally:
        await client.close()
        await server.stop()


def test_host_pools_register_the_pool_itself():
    region = MemoryRegion.from_buffer(bytearray(2048))
    v = FakeVerbs(True)
    reg = rdma_memory.register(v, None, region, 1, lanes=2)
    assert (reg.mode, reg.address, reg.staging) == (rdma_memory.HOST, region.address, None)


def test_staging_buffers_are_pinned_exactly_and_refused_beyond_the_hosts_memory(monkeypatch):
    """torch's pinned allocator rounds up to a power of two (a 34 GiB mirror pinned 64 GiB, and a
    second node's killed the host's nodes): the buffer is page-locked in place at its exact size,
    unlocked when it goes, and one larger than the host's available memory is a clear error."""
    calls: list[tuple] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the CUDA runtime's name)
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None if res == 0 else 1 / 0)
    pool = torch.zeros(3 * 4096 + 512, dtype=torch.uint8)  # not a power of two
    v = FakeVerbs(accept_device=False)
    reg = rdma_memory.register(v, None, device_like(pool), 1)  # a receiver: mirrors the whole pool
    assert reg.mode == rdma_memory.STAGING and reg.staging.numel() == pool.numel()
    assert calls == [("register", reg.address, pool.numel(), 0)]
    view = reg.staging[10:20]
    del reg
    assert calls[-1][0] == "register"  # a view still holds the memory: still locked
    del view
    assert calls[-1][0] == "unregister" and calls[-1][1] == calls[0][1]
    monkeypatch.setattr(rdma_memory, "_available_host_bytes", lambda: 4096)
    with pytest.raises(ValueError, match=r"receiver's mirror of its CUDA pool needs .* pinned host memory"):
        rdma_memory.register(v, None, device_like(pool), 1)
    assert len(calls) == 2  # nothing allocated or locked
