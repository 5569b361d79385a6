"""Session lifecycle: expiry, close during transfer, sender death, reuse safety, fault injection."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    FaultInjector,
    MemoryRegion,
    PoolGeometry,
    SessionError,
    TransferError,
)
from tests.cachestore.helpers import SECRET, pools, sender_process

GEO = PoolGeometry(num_layers=4, num_blocks=32, block_bytes=4096)


def expired_count(server) -> float:
    return (
        server.metrics.registry.get_sample_value(
            "pdserve_cachestore_sessions_expired_total", {"model_name": "unknown", "transport": server.active_transport}
        )
        or 0.0
    )


async def test_session_expires_and_wakes_waiters(pair):
    server, *_ = pair
    server.open_session("slow", [1, 2], timeout=0.2)
    session = server.get_session("slow")
    with pytest.raises(SessionError, match="expired"):
        await session.wait_complete(5)
    assert server.num_sessions == 0 and expired_count(server) == 1
    assert session.safe_to_reuse


async def test_close_during_transfer_fails_the_sender_cleanly(pair):
    server, client, *_ = pair
    creds = server.open_session("r", [1, 2, 3], timeout=5)
    tx = client.open_transfer(creds)
    tx.write_layer(0, [5, 6, 7])
    await tx.finish(5)
    session = server.get_session("r")
    server.close_session("r")
    await session.wait_safe_to_reuse(5)
    tx2 = client.open_transfer(creds)
    tx2.write_layer(1, [5, 6, 7])
    with pytest.raises(TransferError, match="unknown_session"):
        await tx2.finish(5)
    with pytest.raises(SessionError):
        await session.wait_complete(1)


async def test_unfinished_transfer_times_out_with_clear_error(pair):
    server, client, *_ = pair
    creds = server.open_session("r", [1, 2], timeout=5)
    tx = client.open_transfer(creds)
    tx.write_layer(0, [1, 2])
    await tx.finish(5)  # one layer only: the sender is done, the session is not
    assert server.get_session("r").state.value == "open"
    server.close_session("r")


async def test_fault_injection_fails_transfers(pair):
    server, *_ = pair
    src, _ = pools(GEO)
    faulty = CacheStoreClient(
        MemoryRegion.from_buffer(src),
        GEO,
        transport=server.active_transport,
        secret=SECRET,
        faults=FaultInjector(fail_rate=1.0),
    )
    creds = server.open_session("r", [1], timeout=5)
    tx = faulty.open_transfer(creds)
    tx.write_layer(0, [1])
    with pytest.raises(TransferError, match="injected fault"):
        await tx.finish(5)
    server.close_session("r")
    await faulty.close()
    with pytest.raises(ValueError, match="fail_rate"):
        FaultInjector(fail_rate=2.0)


async def test_sender_death_mid_transfer_leaves_session_to_expire():
    src, dst = pools(GEO)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET)
    await server.start()
    try:
        creds = server.open_session("dying", [3, 4], timeout=1.0)
        session = server.get_session("dying")
        proc = mp.get_context("spawn").Process(
            target=sender_process,
            args=(
                creds.to_bytes(),
                (GEO.num_layers, GEO.num_blocks, GEO.block_bytes),
                [0, 1],
                [0],
                0,
                GEO.block_bytes // 2,
            ),
        )
        proc.start()
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
        assert proc.exitcode == 1
        with pytest.raises(SessionError):
            await session.wait_complete(10)
        await session.wait_safe_to_reuse(5)  # the dead writer's connection is gone: blocks are reusable
        assert session.active_writers == 0
    finally:
        await server.stop()
    assert server.num_sessions == 0


async def test_open_session_validates_blocks(pair):
    server, *_ = pair
    with pytest.raises(ValueError, match="block ids"):
        server.open_session("x", [GEO.num_blocks])
    with pytest.raises(ValueError, match="distinct"):
        server.open_session("x", [1, 1])
    server.open_session("x", [1])
    with pytest.raises(ValueError, match="already open"):
        server.open_session("x", [2])
    server.close_session("x")
