"""A transfer's connection and its rdma grant are set up as it opens, on the channel's own threads:
never on the event loop, and not only when the engine hands over the first layer."""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials
from pdserve.cachestore import rdma_verbs, tcp_sender
from tests.cachestore.helpers import SECRET, block, pools

GEO = PoolGeometry(num_layers=2, num_blocks=16, block_bytes=512)


async def test_tcp_channel_connects_off_the_event_loop(monkeypatch):
    src, dst = pools(GEO)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET)
    real_connect, threads = tcp_sender.connect, []

    def slow_connect(endpoint: str, secret: bytes, tls=None):
        threads.append(threading.current_thread())
        time.sleep(0.5)  # a slow peer: the event loop must not wait for it
        return real_connect(endpoint, secret, tls)

    monkeypatch.setattr(tcp_sender, "connect", slow_connect)
    try:
        creds = server.open_session("r", [3, 4], timeout=30)
        started = time.monotonic()
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
        assert time.monotonic() - started < 0.25
        tx.write_layer(0, [0, 1])  # queued while connecting, sent once connected
        tx.write_layer(1, [0, 1])
        await tx.finish(10)
        assert threads and threading.main_thread() not in threads
        assert block(dst, GEO, 1, 4) == block(src, GEO, 1, 1)
        server.close_session("r")
    finally:
        await client.close()
        await server.stop()


async def test_tcp_channel_that_cannot_connect_fails_its_writes():
    src, _ = pools(GEO)
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET)
    creds = SessionCredentials("r", "127.0.0.1:1", "tcp", "00" * 16, "11" * 16, 2, GEO.block_bytes, (0,))
    tx = client.open_transfer(creds)
    tx.write_layer(0, [0])
    try:
        await tx.finish(10)
    except Exception as e:
        assert "cannot connect" in str(e)
    else:
        raise AssertionError("a transfer to a closed port succeeded")
    finally:
        await client.close()


async def test_rdma_grants_are_bound_before_the_first_layer(monkeypatch):
    monkeypatch.setenv(rdma_verbs.EMULATOR_ENV, "1")
    monkeypatch.setenv("PDSERVE_RDMA_QPS", "2")
    src, dst = pools(GEO)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="rdma", secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="rdma", secret=SECRET)
    try:
        creds = server.open_session("r", [5, 6, 9], timeout=30)
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
        session = server.get_session("r")
        assert session is not None
        deadline = time.monotonic() + 10
        while len(session.grants()) < 2 and time.monotonic() < deadline:  # one per lane, no layer written
            await asyncio.sleep(0.01)
        assert len(session.grants()) == 2
        for layer in range(GEO.num_layers):
            tx.write_layer(layer, [0, 1, 2])
        await tx.finish(10)
        assert len(session.grants()) == 2  # the writes used the grants made ahead
        assert block(dst, GEO, 1, 9) == block(src, GEO, 1, 2)
        server.close_session("r")
        await session.wait_safe_to_reuse(10)
    finally:
        await client.close()
        await server.stop()
