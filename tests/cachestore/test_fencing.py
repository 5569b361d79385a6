"""No byte lands in a block after its session ended: a stalled writer is cut off before the blocks
are reused, whichever timeout fires first, and its late write is never acknowledged (issue 13, bug 1)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.cachestore import CacheStoreServer, MemoryRegion, PoolGeometry
from tests.cachestore.helpers import CANARY, SECRET, pools, raw_connect, read_ack, untouched_outside, write_header

GEO = PoolGeometry(num_layers=2, num_blocks=8, block_bytes=64 * 1024)


@pytest.fixture
async def server():
    _, dst = pools(GEO)
    srv = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET)
    await srv.start()
    srv.dst = dst
    try:
        yield srv
    finally:
        await srv.stop()


def late_write(sock: socket.socket, nbytes: int) -> str:
    """Send the rest of the payload after the stall; report what the receiver said."""
    try:
        sock.sendall(b"\x77" * nbytes)
        ack = read_ack(sock)
    except OSError as e:
        return f"refused ({e.__class__.__name__})"
    finally:
        sock.close()
    return "no ack" if ack is None else f"ack status {ack.status}"


@pytest.mark.parametrize("ending", ["close", "expire"])
async def test_stalled_writer_is_cut_off_before_blocks_are_reused(server, ending):
    loop = asyncio.get_running_loop()
    creds = server.open_session("stalled", [2, 3, 4], timeout=0.5 if ending == "expire" else 30)
    session = server.get_session("stalled")
    payload = 3 * GEO.block_bytes
    sock = await loop.run_in_executor(None, raw_connect, creds.endpoint)
    await loop.run_in_executor(None, sock.sendall, write_header(creds, 0, 2, 3) + b"\x77" * (payload // 2))
    deadline = loop.time() + 30  # the receiver thread is inside the blocks
    while session.active_writers == 0 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert session.active_writers == 1
    if ending == "close":
        server.close_session("stalled")
    await session.wait_safe_to_reuse(10)  # returns because the writer was cut off, not after a timeout
    sample = server.metrics.registry.get_sample_value
    cut = sample("pdserve_cachestore_writers_cut_total", {"model_name": "unknown", "transport": "tcp"})
    missed = (
        sample(
            "pdserve_cachestore_rejected_frames_total",
            {"model_name": "unknown", "transport": "tcp", "reason": "deadline"},
        )
        or 0
    )
    assert cut + missed >= 1  # on expiry the receiver's own deadline and the session timer race: either stops it
    # the owner reuses the blocks: a new request's data (the canary) must survive the late bytes
    for layer in range(GEO.num_layers):
        start = GEO.offset(layer, 0)
        server.dst[start : start + GEO.num_blocks * GEO.block_bytes] = (
            bytes([CANARY]) * GEO.num_blocks * GEO.block_bytes
        )
    outcome = await loop.run_in_executor(None, late_write, sock, payload - payload // 2)
    assert not outcome.startswith("ack status 0"), outcome
    assert untouched_outside(server.dst, GEO, set())


async def test_write_finishing_after_close_is_not_acknowledged(server):
    """A writer whose last bytes were already buffered when the session closed gets no OK."""
    creds = server.open_session("late", [1], timeout=30)
    session = server.get_session("late")
    server.close_session("late")
    await session.wait_safe_to_reuse(5)
    loop = asyncio.get_running_loop()

    def attempt() -> int | None:
        sock = raw_connect(creds.endpoint)
        sock.sendall(write_header(creds, 0, 1, 1) + b"\x77" * GEO.block_bytes)
        ack = read_ack(sock)
        sock.close()
        return None if ack is None else ack.status

    assert await loop.run_in_executor(None, attempt) != 0
    assert untouched_outside(server.dst, GEO, set())
