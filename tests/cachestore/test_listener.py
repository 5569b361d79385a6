"""The TCP listener survives fd exhaustion and hostile idle or dripping sockets with bounded threads
(issue 13: bug 5 and bounded CacheStore connections)."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import threading

import pytest

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, wire
from pdserve.cachestore.tcp_listener import TcpLimits
from tests.cachestore.helpers import SECRET, block, pools, raw_connect, until

GEO = PoolGeometry(num_layers=2, num_blocks=8, block_bytes=4096)
LIMITS = TcpLimits(
    max_connections=400, max_unauthenticated=300, max_workers=4, handshake_timeout=1.0, frame_timeout=1.0
)


@pytest.fixture
async def server():
    src, dst = pools(GEO)
    srv = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET, tcp_limits=LIMITS)
    changes: list[bool] = []
    srv.on_listener_change = changes.append
    await srv.start()
    srv.test_pools, srv.changes = (src, dst), changes
    try:
        yield srv
    finally:
        await srv.stop()


def sample(srv, name: str, **labels) -> float:
    return srv.metrics.registry.get_sample_value(name, {"model_name": "unknown", "transport": "tcp", **labels}) or 0.0


async def transfer_works(srv, request_id: str) -> None:
    src, dst = srv.test_pools
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET)
    creds = srv.open_session(request_id, [6, 7], timeout=30)
    tx = client.open_transfer(creds)
    for layer in range(GEO.num_layers):
        tx.write_layer(layer, [1, 2])
    await tx.finish(30)
    await srv.get_session(request_id).wait_complete(30)
    assert block(dst, GEO, 1, 7) == block(src, GEO, 1, 2)
    srv.close_session(request_id)
    await client.close()


async def test_accept_survives_fd_exhaustion(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    client = socket.socket()  # made before the fds run out; the kernel completes its connect
    host, port = server.endpoint.rsplit(":", 1)
    used = len(os.listdir("/proc/self/fd"))
    fillers: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 16, hard))
    try:
        while True:
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        client.connect((host, int(port)))
        assert await until(lambda: sample(server, "pdserve_cachestore_accept_errors_total") >= 1)
        assert not server.listening and server.changes[-1] is False
        assert sample(server, "pdserve_cachestore_listener_up") == 0
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:  # the listener retries on its own: the waiting connection is accepted and gets its nonce
        client.settimeout(30)
        assert len(client.recv(wire.NONCE_BYTES, socket.MSG_WAITALL)) == wire.NONCE_BYTES
    finally:
        client.close()
    assert server.listening and server.changes[-1] is True
    await transfer_works(server, "after-emfile")


async def test_idle_and_dripping_sockets_do_not_grow_threads(server):
    loop = asyncio.get_running_loop()
    threads_before = threading.active_count()
    host, port = server.endpoint.rsplit(":", 1)

    def open_hostile() -> list[socket.socket]:
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(150)]  # never authenticate
        for _ in range(50):  # authenticate, then start a frame header and drip it
            s = raw_connect(server.endpoint)
            s.sendall(b"P")
            socks.append(s)
        return socks

    socks = await loop.run_in_executor(None, open_hostile)
    try:

        def timed_out() -> float:
            return sum(
                sample(server, "pdserve_cachestore_rejected_frames_total", reason=r)
                for r in ("handshake_timeout", "frame_timeout")
            )

        # all 200 reached the listener (on a slow machine the first may already have timed out)
        assert await until(lambda: server._listener.num_connections + timed_out() >= 200)
        await transfer_works(server, "beside-idle-sockets")  # a legit sender is served meanwhile
        # 1 poller + at most max_workers receivers + this test's executor thread, not one per socket
        assert threading.active_count() <= threads_before + 1 + LIMITS.max_workers + 1
        # handshake and frame-header deadlines close them all
        assert await until(lambda: server._listener.num_connections == 0)
        assert sample(server, "pdserve_cachestore_rejected_frames_total", reason="handshake_timeout") == 150
        assert sample(server, "pdserve_cachestore_rejected_frames_total", reason="frame_timeout") == 50
    finally:
        for s in socks:
            s.close()
    await transfer_works(server, "after-idle-sockets")


async def test_connection_caps_refuse_the_excess(server):
    limits = TcpLimits(max_connections=20, max_unauthenticated=10, handshake_timeout=30.0)
    src, dst = pools(GEO)
    capped = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET, tcp_limits=limits)
    await capped.start()
    host, port = capped.endpoint.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(25)]
    try:
        assert await until(
            lambda: sample(capped, "pdserve_cachestore_rejected_frames_total", reason="too_many_connections") == 15
        )
        assert capped._listener.num_connections == 10
    finally:
        for s in socks:
            s.close()
        await capped.stop()
