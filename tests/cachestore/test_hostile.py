"""Hostile or broken senders are refused; no byte lands outside the target blocks; the server keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, wire
from tests.cachestore.helpers import (
    SECRET,
    block,
    pools,
    raw_connect,
    read_ack,
    rejected,
    untouched_outside,
    write_header,
)

GEO = PoolGeometry(num_layers=3, num_blocks=16, block_bytes=1024)


@pytest.fixture
async def server():
    src, dst = pools(GEO)
    srv = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET)
    await srv.start()
    srv.test_pools = (src, dst)
    try:
        yield srv
    finally:
        await srv.stop()
    assert srv.num_sessions == 0


async def still_serves(srv) -> None:
    """A well-behaved sender still gets its session through."""
    src, dst = srv.test_pools
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET)
    creds = srv.open_session("good", [12, 13], timeout=5)
    tx = client.open_transfer(creds)
    for layer in range(GEO.num_layers):
        tx.write_layer(layer, [1, 2])
    await tx.finish(5)
    await srv.get_session("good").wait_complete(5)
    assert block(dst, GEO, 0, 12) == block(src, GEO, 0, 1)
    srv.close_session("good")
    await client.close()


def in_thread(fn):
    return asyncio.get_running_loop().run_in_executor(None, fn)


@pytest.mark.parametrize(
    "case,reason",
    [
        ("wrong_token", "bad_token"),
        ("unknown_session", "unknown_session"),
        ("block_outside", "bad_block"),
        ("layer_out_of_range", "bad_layer"),
        ("short_length", "bad_length"),
    ],
)
async def test_refused_writes(server, case, reason):
    creds = server.open_session("victim", [4, 5], timeout=5)
    header = {
        "wrong_token": lambda: write_header(creds, 0, 4, 1, token=b"x" * 16),
        "unknown_session": lambda: write_header(creds, 0, 4, 1, session_id=os.urandom(16)),
        "block_outside": lambda: write_header(creds, 0, 5, 2),  # 5 is ours, 6 is not
        "layer_out_of_range": lambda: write_header(creds, 3, 4, 1),
        "short_length": lambda: write_header(creds, 0, 4, 1, payload_len=GEO.block_bytes - 1),
    }[case]()
    payload_len = wire.unpack(header).payload_len

    def attack() -> wire.Header | None:
        sock = raw_connect(server.endpoint)
        sock.sendall(header + b"\xff" * payload_len)
        ack = read_ack(sock)
        sock.close()
        return ack

    ack = await in_thread(attack)
    assert ack is not None and ack.status != wire.OK
    assert rejected(server, reason) == 1
    assert untouched_outside(server.test_pools[1], GEO, set())
    server.close_session("victim")
    await still_serves(server)


@pytest.mark.parametrize("case", ["truncated", "oversized_length", "garbage", "disconnect_mid_payload", "bad_secret"])
async def test_corrupt_streams_are_dropped(server, case):
    creds = server.open_session("victim", [4, 5], timeout=5)

    def attack() -> bytes:
        secret = b"wrong" if case == "bad_secret" else SECRET
        sock = raw_connect(server.endpoint, secret)
        if case == "truncated":
            sock.sendall(write_header(creds, 0, 4, 1)[:20])
            sock.shutdown(socket.SHUT_WR)
        elif case == "oversized_length":
            sock.sendall(write_header(creds, 0, 4, 1, payload_len=wire.MAX_FRAME_BYTES + 1))
        elif case == "garbage":
            sock.sendall(os.urandom(wire.HEADER_BYTES * 3))
        elif case == "disconnect_mid_payload":
            sock.sendall(write_header(creds, 0, 4, 2) + b"\x11" * (GEO.block_bytes + 100))
            sock.shutdown(socket.SHUT_WR)
        else:
            sock.sendall(write_header(creds, 0, 4, 1) + b"\x22" * GEO.block_bytes)
        sock.settimeout(5)
        try:
            return sock.recv(1)  # the server closes the connection: b""
        except ConnectionError:
            return b""
        finally:
            sock.close()

    assert await in_thread(attack) == b""
    allowed = {(0, 4), (0, 5)} if case == "disconnect_mid_payload" else set()
    assert untouched_outside(server.test_pools[1], GEO, allowed)
    if case == "bad_secret":
        assert rejected(server, "bad_secret") == 1
    session = server.get_session("victim")
    assert session is not None and session.state.value == "open"  # not completed by partial data
    server.close_session("victim")
    await session.wait_safe_to_reuse(5)
    await still_serves(server)


def writev_frame(creds, layer: int, ids: list[int], payload_len: int | None = None, count: int | None = None) -> bytes:
    """A WRITEV header + id list; `count`/`payload_len` may lie about the list."""
    n = len(ids) if count is None else count
    length = len(ids) * creds.block_bytes if payload_len is None else payload_len
    return wire.Header(
        wire.KIND_WRITEV, 0, bytes.fromhex(creds.session_id), bytes.fromhex(creds.token), layer, 0, n, 1, length
    ).pack() + wire.pack_ids(ids)


@pytest.mark.parametrize(
    "case,reason",
    [
        ("duplicate_ids", "bad_block"),
        ("outsider_in_the_middle", "bad_block"),
        ("length_mismatch", "bad_length"),
        ("empty_list", "bad_block"),
    ],
)
async def test_refused_vectored_writes(server, case, reason):
    creds = server.open_session("victim", [4, 9, 2], timeout=5)
    ids = {
        "duplicate_ids": [4, 9, 4],
        "outsider_in_the_middle": [4, 10, 2],
        "length_mismatch": [4, 9, 2],
        "empty_list": [],
    }[case]
    payload_len = (len(ids) + (1 if case == "length_mismatch" else 0)) * GEO.block_bytes
    frame = writev_frame(creds, 0, ids, payload_len=payload_len)

    def attack() -> wire.Header | None:
        sock = raw_connect(server.endpoint)
        sock.sendall(frame + b"\xff" * payload_len)
        ack = read_ack(sock)
        sock.close()
        return ack

    ack = await in_thread(attack)
    assert ack is not None and ack.status != wire.OK  # refused as a whole: not one block of the list landed
    assert rejected(server, reason) == 1
    assert untouched_outside(server.test_pools[1], GEO, set())
    server.close_session("victim")
    await still_serves(server)


async def test_truncated_vectored_payload_lands_nothing_outside_and_never_completes(server):
    creds = server.open_session("victim", [4, 9, 2], timeout=5)

    def attack() -> bytes:
        sock = raw_connect(server.endpoint)
        sock.sendall(writev_frame(creds, 1, [9, 2, 4]) + b"\x33" * (GEO.block_bytes + 100))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        try:
            return sock.recv(1)
        except ConnectionError:
            return b""
        finally:
            sock.close()

    assert await in_thread(attack) == b""  # dropped, never acknowledged
    assert untouched_outside(server.test_pools[1], GEO, {(1, 9), (1, 2)})
    session = server.get_session("victim")
    assert session.state.value == "open" and not session.landed
    server.close_session("victim")
    await session.wait_safe_to_reuse(5)
    await still_serves(server)


async def test_scattered_layer_lands_in_place(server):
    src, dst = server.test_pools
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET)
    creds = server.open_session("scattered", [11, 3, 7, 0], timeout=5)
    tx = client.open_transfer(creds)
    for layer in range(GEO.num_layers):
        tx.write_layer(layer, [5, 1, 14, 8])
    await tx.finish(5)
    await server.get_session("scattered").wait_complete(5)
    for layer in range(GEO.num_layers):
        for s, d in zip([5, 1, 14, 8], [11, 3, 7, 0]):
            assert block(dst, GEO, layer, d) == block(src, GEO, layer, s)
    assert untouched_outside(dst, GEO, {(layer, d) for layer in range(GEO.num_layers) for d in [11, 3, 7, 0]})
    server.close_session("scattered")
    await client.close()


async def test_broken_more_promise_still_gets_its_ack(server):
    """A frame flagged FLAG_MORE ("another frame is right behind") whose follower never comes is
    acknowledged anyway once the receiver stops waiting; a follower that does come is covered by one
    cumulative ack."""
    src, dst = server.test_pools
    creds = server.open_session("promise", [4, 9], timeout=5)
    sid, token = bytes.fromhex(creds.session_id), bytes.fromhex(creds.token)

    def frame(layer: int, seq: int, flags: int) -> bytes:
        h = wire.Header(wire.KIND_WRITEV, flags, sid, token, layer, 0, 2, seq, 2 * GEO.block_bytes)
        return h.pack() + wire.pack_ids([4, 9]) + block(src, GEO, layer, 1) + block(src, GEO, layer, 2)

    def send() -> list[wire.Header | None]:
        sock = raw_connect(server.endpoint)
        try:
            sock.sendall(frame(0, 1, wire.FLAG_MORE))  # nothing follows: the ack must still come
            first = read_ack(sock)
            sock.sendall(frame(1, 2, wire.FLAG_MORE) + frame(2, 3, 0))
            acks = [read_ack(sock)]  # normally one ack for both (more only if the follower came late)
            while acks[-1] is not None and acks[-1].seq < 3:
                acks.append(read_ack(sock))
            return [first, *acks]
        finally:
            sock.close()

    first, *rest = await in_thread(send)
    assert first is not None and first.status == wire.OK and first.seq == 1
    assert all(a is not None and a.status == wire.OK for a in rest) and rest[-1].seq == 3
    await server.get_session("promise").wait_complete(5)
    assert block(dst, GEO, 2, 9) == block(src, GEO, 2, 2)
    server.close_session("promise")
