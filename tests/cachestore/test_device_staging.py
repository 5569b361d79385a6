"""A device (CUDA) pool over TCP: the sender stages each run through host memory instead of sending
an empty view, and both sides reuse one staging buffer per connection.

On CPU, a pool "reports itself as device memory" exactly as `MemoryRegion.from_tensor` builds it for
a CUDA tensor: an empty host view plus the tensor. Before the fix the sender announced
count x block_bytes and sent 0 bytes, so the stream desynchronised and the transfer failed.
"""

from __future__ import annotations

import gc

import torch

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials
from pdserve.cachestore.staging import HostStaging
from tests.cachestore.helpers import SECRET

GEO = PoolGeometry(num_layers=3, num_blocks=16, block_bytes=512)


def _device_like(tensor: torch.Tensor) -> MemoryRegion:
    return MemoryRegion(memoryview(bytearray(0)), tensor, is_device=True)


async def test_device_pool_sender_and_receiver_are_bit_exact_through_staging(monkeypatch):
    created: list[HostStaging] = []
    init = HostStaging.__init__

    def counting_init(self, *a, **kw):
        init(self, *a, **kw)
        created.append(self)

    monkeypatch.setattr(HostStaging, "__init__", counting_init)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (GEO.total_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.full((GEO.total_bytes,), 0xA5, dtype=torch.uint8)
    server = CacheStoreServer(_device_like(dst), GEO, transport="tcp", secret=SECRET)
    await server.start()
    client = CacheStoreClient(_device_like(src), GEO, transport="tcp", secret=SECRET)
    try:
        for rid, src_blocks, dst_blocks in [("a", [1, 2, 3, 9], [4, 5, 6, 0]), ("b", [7], [12])]:
            creds = server.open_session(rid, dst_blocks, GEO.num_layers, timeout=10)
            tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
            for layer in range(GEO.num_layers):
                tx.write_layer(layer, src_blocks)
            await tx.finish(10)
            session = server.get_session(rid)
            await session.wait_complete(5)
            server.close_session(rid)
            await session.wait_safe_to_reuse(5)
            for layer in range(GEO.num_layers):
                for s, d in zip(src_blocks, dst_blocks):
                    a, b = GEO.offset(layer, s), GEO.offset(layer, d)
                    assert torch.equal(dst[b : b + GEO.block_bytes], src[a : a + GEO.block_bytes]), (rid, layer, s, d)
        # the sender's buffer per connection and the receiver's per worker thread are reused across the
        # 6 frames (re-allocated only to grow), never allocated per frame
        (channel,) = client._channels.values()
        assert channel._staging in created and channel._staging.allocations <= 2
        receivers = [s for s in created if s is not channel._staging]
        assert 1 <= len(receivers) <= 2 and sum(s.allocations for s in receivers) <= 3
    finally:
        await client.close()
        await server.stop()
        gc.collect()  # close what the run left to the collector now, not inside a later test's fd budget


def test_staging_reuses_its_buffer_and_copies_the_requested_bytes():
    pool = torch.arange(4096, dtype=torch.int32)  # 16 KiB
    staging = HostStaging(1024)
    first = staging.read(pool, 4, 1024)
    assert bytes(first) == pool.view(torch.uint8)[4:1028].numpy().tobytes()
    staging.read(pool, 0, 512)
    assert staging.allocations == 1  # smaller frames reuse the buffer
    landing = staging.landing(8)
    landing[:] = bytes(range(8))
    staging.commit(pool, 16, 8)
    assert pool.view(torch.uint8)[16:24].tolist() == list(range(8))
    staging.read(pool, 0, 4096)
    assert staging.allocations == 2
