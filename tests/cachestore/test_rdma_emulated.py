"""The rdma transport end to end on the emulated verbs device (cachestore.verbs_emu).

Sender and receiver share this process, but their QPs are connected through emulated GIDs, so every
WRITE goes over the emulated wire (a loopback socket to the device endpoint), as between two nodes.
EMULATED: this proves the transport's logic against the verbs rules, not a NIC.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    MemoryRegion,
    PoolGeometry,
    SessionCredentials,
    TransferError,
    rdma,
    rdma_verbs,
)
from pdserve.cachestore.verbs_emu import FABRIC
from tests.cachestore.helpers import SECRET, block, pools, untouched_outside

GEO = PoolGeometry(num_layers=4, num_blocks=32, block_bytes=1024)


@pytest.fixture
async def rdma_pair(monkeypatch):
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    src, dst = pools(GEO)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="rdma", secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="rdma", secret=SECRET)
    try:
        yield server, client, src, dst
    finally:
        FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
        await client.close()
        await server.stop()


def _from_engine_thread(fn) -> None:
    """Run `fn` on a thread standing in for the engine thread (the layer hook's caller)."""
    t = threading.Thread(target=fn, name="engine-thread")
    t.start()
    t.join(10)


async def _transfer(server, client, rid, src_blocks, dst_blocks, layers, timeout=20.0):
    creds = server.open_session(rid, dst_blocks, GEO.num_layers, timeout=30)
    tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
    _from_engine_thread(lambda: [tx.write_layer(layer, src_blocks) for layer in layers])
    try:
        await tx.finish(timeout)
    finally:
        session = server.get_session(rid)
        server.close_session(rid)
        await session.wait_safe_to_reuse(10)
    return tx


async def test_rdma_transfer_is_bit_exact_and_the_engine_thread_never_polls(rdma_pair):
    server, client, src, dst = rdma_pair
    src_blocks, dst_blocks = [3, 4, 5, 9, 20], [7, 8, 9, 1, 30]
    wire_connections = FABRIC.endpoint().connections
    tx = await _transfer(server, client, "r1", src_blocks, dst_blocks, [2, 0, 3, 1])
    for layer in range(GEO.num_layers):
        for s, d in zip(src_blocks, dst_blocks):
            assert block(dst, GEO, layer, d) == block(src, GEO, layer, s)
    assert untouched_outside(dst, GEO, {(layer, d) for layer in range(GEO.num_layers) for d in dst_blocks})
    # posted and polled on the lanes' own threads only, and round robin used both QPs
    assert tx._channel.poll_threads == {"cachestore-rdma-0", "cachestore-rdma-1"}
    assert FABRIC.endpoint().connections >= wire_connections + 2  # one wire connection per lane's QP


async def test_qp_forced_to_error_fails_that_request_and_the_next_gets_a_new_qp(rdma_pair):
    server, client, src, dst = rdma_pair
    FABRIC.faults.write_delay_s = 0.05  # keep WRITEs in flight while the QP breaks
    creds = server.open_session("broken", [1, 2], GEO.num_layers, timeout=30)
    tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
    _from_engine_thread(lambda: [tx.write_layer(layer, [5, 9]) for layer in range(GEO.num_layers)])
    channel = tx._channel
    lane = channel.lanes[0]
    for _ in range(500):  # wait (bounded) until the lane's QP is connected, then break it
        if lane._peer is not None:
            break
        await asyncio.sleep(0.01)
    broken_qp = lane.qp.qp_num
    lane.qp.to_error()
    with pytest.raises(TransferError, match="RDMA"):
        await tx.finish(20)
    assert lane.broken
    session = server.get_session("broken")
    server.close_session("broken")
    await session.wait_safe_to_reuse(10)
    FABRIC.faults.write_delay_s = 0.0
    tx2 = await _transfer(server, client, "next", [6, 8], [12, 14], range(GEO.num_layers))
    assert tx2._channel is channel and channel.replaced >= 1  # the failed lane was torn down and rebuilt
    assert channel.lanes[0] is not lane and channel.lanes[0].qp.qp_num != broken_qp
    assert all(block(dst, GEO, layer, 12) == block(src, GEO, layer, 6) for layer in range(GEO.num_layers))
    assert all(block(dst, GEO, layer, 14) == block(src, GEO, layer, 8) for layer in range(GEO.num_layers))


async def test_lost_completion_fails_the_transfer_within_the_deadline(rdma_pair, monkeypatch):
    server, client, src, dst = rdma_pair
    monkeypatch.setattr(rdma_verbs, "COMPLETION_TIMEOUT", 0.5)
    monkeypatch.setenv(rdma.QPS_ENV, "1")  # one lane: its grant is in place before the completion is lost
    creds = server.open_session("lost", [2], GEO.num_layers, timeout=30)
    tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
    _from_engine_thread(lambda: tx.write_layer(0, [1]))
    await tx.finish(20)
    FABRIC.faults.drop_completions = 1
    _from_engine_thread(lambda: tx.write_layer(1, [1]))
    with pytest.raises(TransferError, match="no completion"):
        await tx.finish(20)
    server.close_session("lost")
