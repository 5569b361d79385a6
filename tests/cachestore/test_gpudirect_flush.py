"""GPUDirect write visibility (`cachestore.gpudirect`): a receiver whose pool the NIC writes
directly flushes those writes, where the device needs it, after each NOTIFY's WRITEs completed and
before the NOTIFY is acknowledged, so the engine's first read of the blocks sees them.

NOT EXERCISED with a NIC: the transfer runs on the emulated verbs device with GPUDirect forced on
over a pool that reports itself as device memory, and a stand-in CUDA runtime records the calls."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    PoolGeometry,
    SessionCredentials,
    gpudirect,
    rdma,
    rdma_memory,
)
from pdserve.cachestore.server import CacheStoreServer as Server
from pdserve.cachestore.verbs_emu import FABRIC
from tests.cachestore.helpers import SECRET
from tests.cachestore.test_rdma_emulated import _from_engine_thread
from tests.cachestore.test_rdma_memory import FakeVerbs, device_like

GEO = PoolGeometry(num_layers=3, num_blocks=16, block_bytes=512)


class Runtime:
    """The CUDA runtime calls WriteFlush makes, answered as a device with the given GPUDirect
    ordering and flush options would, recorded in `calls` (with `journal`, shared with the test)."""

    def __init__(self, ordering: int, options: int, journal: list | None = None) -> None:
        self.attributes = {gpudirect.ATTR_WRITES_ORDERING: ordering, gpudirect.ATTR_FLUSH_OPTIONS: options}
        self.journal = journal if journal is not None else []

    def cudaDeviceGetAttribute(self, ref, attr: int, device: int) -> int:  # noqa: N802 (CUDA's name)
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.attributes[attr]
        return 0

    def cudaSetDevice(self, device: int) -> int:  # noqa: N802
        self.journal.append(("set_device", device))
        return 0

    def cudaDeviceFlushGPUDirectRDMAWrites(self, target: int, scope: int) -> int:  # noqa: N802
        assert (target, scope) == (gpudirect.TARGET_CURRENT_DEVICE, gpudirect.SCOPE_TO_OWNER)
        self.journal.append(("flush",))
        return 0


UNORDERED = dict(ordering=0, options=gpudirect.FLUSH_OPTION_HOST)


def test_a_device_that_orders_its_writes_needs_no_flush():
    runtime = Runtime(ordering=gpudirect.ORDERING_OWNER, options=0)
    flush = gpudirect.WriteFlush(0, runtime)
    flush()
    assert not flush.needed and flush.flushes == 0 and runtime.journal == []


def test_an_unordered_device_flushes_its_own_writes_on_each_call():
    runtime = Runtime(**UNORDERED)
    flush = gpudirect.WriteFlush(3, runtime)
    flush()
    flush()
    assert flush.needed and flush.flushes == 2
    assert runtime.journal == [("set_device", 3), ("flush",)] * 2


def test_a_device_that_can_neither_order_nor_flush_falls_back_to_staging(monkeypatch):
    with pytest.raises(gpudirect.GpuDirectUnsupported, match="neither orders"):
        gpudirect.WriteFlush(0, Runtime(ordering=0, options=0))
    pool = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setattr(rdma_memory, "PEER_MEMORY_PATHS", ("/",))
    monkeypatch.setattr(gpudirect, "load_cudart", lambda: Runtime(ordering=0, options=0))
    v = FakeVerbs(accept_device=True, device_address=pool.data_ptr())
    reg = rdma_memory.register(v, None, device_like(pool), 1)  # a receiver
    assert reg.mode == rdma_memory.STAGING and "cannot be made visible" in reg.reason
    assert reg.flush is None and pool.data_ptr() not in v.registered
    # a sender's pool is only read by its NIC: no flush, GPUDirect as before
    sender = rdma_memory.register(v, None, device_like(pool), 1, lanes=2, block_bytes=512)
    assert sender.mode == rdma_memory.GPUDIRECT and sender.flush is None


async def test_each_notify_is_flushed_before_it_is_acknowledged_and_before_the_first_read(monkeypatch):
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    monkeypatch.setenv(rdma_memory.GPUDIRECT_ENV, "on")  # the emulated device has no peer-memory client
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    journal: list = []
    monkeypatch.setattr(gpudirect, "load_cudart", lambda: Runtime(**UNORDERED, journal=journal))
    end_write = Server.end_write

    def acknowledging(self, session, writer, layer, block_ids, ok, *rest):
        journal.append(("ack", layer, ok))
        return end_write(self, session, writer, layer, block_ids, ok, *rest)

    monkeypatch.setattr(Server, "end_write", acknowledging)
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (GEO.total_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(GEO.total_bytes, dtype=torch.uint8)
    server = CacheStoreServer(device_like(dst), GEO, transport="rdma", secret=SECRET)
    await server.start()
    client = CacheStoreClient(device_like(src), GEO, transport="rdma", secret=SECRET)
    try:
        reg = server._rdma.res.registration
        assert reg.mode == rdma_memory.GPUDIRECT and server._rdma.remote_base == dst.data_ptr()  # no mirror
        src_blocks, dst_blocks = [1, 2, 3], [9, 4, 11]
        creds = server.open_session("r", dst_blocks, GEO.num_layers, timeout=30)
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
        _from_engine_thread(lambda: [tx.write_layer(layer, src_blocks) for layer in range(GEO.num_layers)])
        await tx.finish(20)
        journal.append(("first_read",))
        for layer in range(GEO.num_layers):
            for s, d in zip(src_blocks, dst_blocks):
                a, b = GEO.offset(layer, s), GEO.offset(layer, d)
                assert torch.equal(dst[b : b + GEO.block_bytes], src[a : a + GEO.block_bytes])
        events = [e for e in journal if e[0] != "set_device"]
        acks = [e for e in events if e[0] == "ack"]
        assert {e[1] for e in acks} == set(range(GEO.num_layers)) and all(e[2] for e in acks)
        for i, event in enumerate(events):  # every acknowledgement comes right after its own flush
            if event[0] == "ack":
                assert events[i - 1] == ("flush",), events
        assert events[-1] == ("first_read",) and reg.flush.flushes == len(acks)  # one per NOTIFY
    finally:
        await client.close()
        await server.stop()
