"""Per-session remote access and completion-based fencing of the rdma transport, on the emulated
verbs device (EMULATED: proves our logic against the verbs rules, not a NIC).

Every test checks canary bytes in the receiver's pool: a refused WRITE must land nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    MemoryRegion,
    PoolGeometry,
    SessionCredentials,
    TransferError,
    rdma,
    rdma_access,
)
from pdserve.cachestore.geometry import Run
from pdserve.cachestore.verbs_emu import FABRIC
from tests.cachestore.helpers import CANARY, SECRET, block, pools
from tests.cachestore.test_rdma_emulated import _from_engine_thread, _transfer

GEO = PoolGeometry(num_layers=4, num_blocks=32, block_bytes=1024)
CANARY_BLOCK = bytes([CANARY]) * GEO.block_bytes


@pytest.fixture(params=["mw", "mr"])
async def pair(request, monkeypatch):
    """One receiver and one sender with ONE lane (so a lane's cached grant is the one reused);
    remote access by type-2 windows, or by the per-session MR fallback."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    monkeypatch.setenv(rdma.QPS_ENV, "1")
    monkeypatch.setenv(rdma_access.ACCESS_ENV, request.param)
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    src, dst = pools(GEO)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="rdma", secret=SECRET)
    await server.start()
    assert server._rdma.use_mw == (request.param == "mw")
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="rdma", secret=SECRET)
    try:
        yield server, client, src, dst
    finally:
        FABRIC.faults.write_delay_s = 0.0
        await client.close()
        await server.stop()


def fill_canary(dst: bytearray, blocks: list[int]) -> None:
    for layer in range(GEO.num_layers):
        for b in blocks:
            start = GEO.offset(layer, b)
            dst[start : start + GEO.block_bytes] = CANARY_BLOCK


def all_canary(dst: bytearray, blocks: list[int]) -> bool:
    return all(block(dst, GEO, layer, b) == CANARY_BLOCK for layer in range(GEO.num_layers) for b in blocks)


async def until(predicate, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_credentials_carry_no_key_and_the_pool_mr_grants_no_remote_write(pair):
    server, client, src, dst = pair
    creds = server.open_session("k", [1, 2], GEO.num_layers)
    assert "rkey" not in creds.rdma  # keys come only through a grant, bound to the asking QP
    mr = server._rdma.res.mr
    assert not mr.access & rdma.verbs().enums.IBV_ACCESS_REMOTE_WRITE
    server.close_session("k")


async def test_a_write_with_a_stale_credential_after_close_lands_nothing(pair):
    server, client, src, dst = pair
    creds = server.open_session("s", [4, 5], GEO.num_layers, timeout=30)
    wire_creds = SessionCredentials.from_bytes(creds.to_bytes())
    tx = client.open_transfer(wire_creds)
    _from_engine_thread(lambda: [tx.write_layer(layer, [1, 2]) for layer in range(GEO.num_layers)])
    await tx.finish(20)
    session = server.close_session("s")
    await session.wait_safe_to_reuse(10)  # the grant's keys are invalidated before this returns
    fill_canary(dst, [4, 5])  # the blocks now belong to someone else
    stale = client.open_transfer(wire_creds)  # the sender still holds the old grant for this session
    _from_engine_thread(lambda: stale.write_layer(0, [1, 2]))
    with pytest.raises(TransferError, match="remote access error"):
        await stale.finish(20)
    assert all_canary(dst, [4, 5])
    tx2 = await _transfer(server, client, "after", [7], [9], range(GEO.num_layers))  # a new QP serves the next
    assert not tx2.failed and block(dst, GEO, 3, 9) == block(src, GEO, 3, 7)


async def test_foreign_keys_and_out_of_session_addresses_land_nothing(pair):
    """A sender that forges its window table (another session's rkey, a wider range, the pool
    MR's rkey) is refused by the responder: remote access error, no byte lands, request fails."""
    server, client, src, dst = pair
    mine = server.open_session("mine", [1, 2], GEO.num_layers, timeout=30)
    theirs = server.open_session("theirs", [10, 11], GEO.num_layers, timeout=30)
    resources = client._channel_for(mine)._resources
    lane = rdma.RdmaLane(client, mine, 0, resources)
    try:
        await until(lambda: lane._peer is not None)
        windows = await asyncio.to_thread(lane._grant, mine)
        my_rkey = windows[0][2]
        base, their_addr = server.region.address, server.region.address + GEO.offset(0, 10)
        forgeries = [
            (theirs, [[their_addr, 2 * GEO.block_bytes, my_rkey]]),  # my key, their blocks
            (mine, [[base, GEO.total_bytes, my_rkey]]),  # my key, claimed over the whole pool
            (theirs, [[base, GEO.total_bytes, server._rdma.res.mr.rkey]]),  # the pool MR's own key
        ]
        for creds, forged in forgeries:
            if lane.broken:  # each refusal breaks the QP (verbs: an error completion moves it to ERR)
                lane = rdma.RdmaLane(client, mine, 0, resources)
                await until(lambda: lane._peer is not None)
            lane._grants[creds.session_id] = forged
            tx = client.open_transfer(creds)
            tx.expected += 1
            target = 10 if creds is theirs else 5  # block 5 is outside "mine"
            lane.submit(tx, 0, Run(3, target, 1), None)
            with pytest.raises(TransferError, match="remote access error"):
                await tx.finish(20)
            assert block(dst, GEO, 0, target) == CANARY_BLOCK
        assert all_canary(dst, [1, 2, 5, 10, 11])
    finally:
        lane.close()
        server.close_session("mine")
        server.close_session("theirs")


async def test_abort_mid_transfer_no_byte_lands_after_the_blocks_are_freed(pair):
    """Completion-based fencing: WRITEs are delayed in the QP (fault hook) when the request is
    aborted and its session closed; once wait_safe_to_reuse returns, the blocks are refilled, and
    the late WRITEs must fail at the responder instead of landing."""
    server, client, src, dst = pair
    FABRIC.faults.write_delay_s = 0.2
    creds = server.open_session("abort", [6, 7], GEO.num_layers, timeout=30)
    tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
    _from_engine_thread(lambda: [tx.write_layer(layer, [1, 2]) for layer in range(GEO.num_layers)])
    session = server.get_session("abort")
    await until(lambda: session.grants())  # the lane holds keys: its first WRITE is being posted
    await asyncio.sleep(0.05)
    tx.abort("request aborted")
    server.close_session("abort")
    await session.wait_safe_to_reuse(10)
    fill_canary(dst, [6, 7])  # the allocator handed the blocks to a new request
    lane = tx._channel.lanes[0]
    await until(lambda: lane.broken)  # the delayed WRITE ran after the close ...
    assert "remote access error" in lane.error  # ... and was refused by the responder
    await asyncio.sleep(0.3)  # nothing else is in flight; give a stray WRITE the time to show up
    assert all_canary(dst, [6, 7])


async def test_grants_per_session_are_bounded(pair, monkeypatch):
    """A peer holding the token cannot make the receiver bind windows without limit."""
    from pdserve.cachestore import server as server_module

    monkeypatch.setattr(server_module, "MAX_GRANTS_PER_SESSION", 3)
    server, client, src, dst = pair
    creds = server.open_session("g", [1], GEO.num_layers, timeout=30)
    lane = rdma.RdmaLane(client, creds, 0, client._channel_for(creds)._resources)
    try:
        await until(lambda: lane._peer is not None)
        for _ in range(3):
            lane._grants.clear()
            await asyncio.to_thread(lane._grant, creds)
        lane._grants.clear()
        with pytest.raises(PermissionError, match="session_closed"):
            await asyncio.to_thread(lane._grant, creds)
        assert len(server.get_session("g").grants()) == 3
    finally:
        lane.close()
        session = server.close_session("g")
        await session.wait_safe_to_reuse(10)
    assert not session.grants()


async def test_grant_requests_with_a_bad_token_or_a_foreign_qp_are_refused(pair):
    import dataclasses

    server, client, src, dst = pair
    creds = server.open_session("t", [1], GEO.num_layers, timeout=30)
    lane = rdma.RdmaLane(client, creds, 0, client._channel_for(creds)._resources)
    try:
        await until(lambda: lane._peer is not None)
        forged = dataclasses.replace(creds, token="00" * 16)
        with pytest.raises(PermissionError, match="bad_token"):
            await asyncio.to_thread(lane._grant, forged)
        lane._peer = dataclasses.replace(lane._peer, qp_num=999_999)  # no responder QP of that number
        with pytest.raises(PermissionError, match="unknown_session"):
            await asyncio.to_thread(lane._grant, creds)
        assert not server.get_session("t").grants()  # nothing was bound
    finally:
        lane.close()
        server.close_session("t")
