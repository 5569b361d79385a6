"""The rdma transport between two processes on the emulated verbs device: the receiver
(CacheStoreServer) runs in a child process, so its grants, windows and key checks live there and
every WRITE crosses the emulated wire. EMULATED: proves our logic across processes, not a NIC."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from pdserve.cachestore import CacheStoreClient, MemoryRegion, PoolGeometry, SessionCredentials, TransferError, rdma
from tests.cachestore.helpers import CANARY, SECRET, pools
from tests.cachestore.test_rdma_emulated import _from_engine_thread

GEO = PoolGeometry(num_layers=2, num_blocks=16, block_bytes=1024)


def receiver_process(conn) -> None:
    """Child: an rdma CacheStoreServer over a canary pool, driven by messages on `conn`."""
    from pdserve.cachestore import CacheStoreServer

    async def main() -> None:
        _, dst = pools(GEO)
        server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="rdma", secret=SECRET)
        await server.start()
        conn.send(server.endpoint)
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg is None:
                break
            if msg[0] == "open":
                conn.send(server.open_session(msg[1], msg[2], timeout=60).to_bytes())
            elif msg[0] == "close":  # close, wait until no key reaches the blocks, hand them to "someone else"
                session = server.close_session(msg[1])
                await session.wait_safe_to_reuse(10)
                for layer in range(GEO.num_layers):
                    for b in msg[2]:
                        start = GEO.offset(layer, b)
                        dst[start : start + GEO.block_bytes] = bytes([CANARY]) * GEO.block_bytes
                conn.send(True)
            elif msg[0] == "dump":
                conn.send(bytes(dst))
        await server.stop()

    asyncio.run(main())


@pytest.fixture
async def remote_receiver(monkeypatch):
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")  # inherited by the child
    monkeypatch.setenv(rdma.QPS_ENV, "1")  # one lane: the stale write reuses the lane's cached grant
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(child,), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()

    async def ask(*msg):
        parent.send(msg)
        return await loop.run_in_executor(None, parent.recv)

    try:
        await loop.run_in_executor(None, parent.poll, 90)
        parent.recv()
        src, _ = pools(GEO)
        client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="rdma", secret=SECRET)
        yield client, src, ask
        await client.close()
        parent.send(None)
    finally:
        await loop.run_in_executor(None, proc.join, 15)
        if proc.is_alive():
            proc.kill()


async def test_write_lands_across_processes_and_a_stale_credential_lands_nothing(remote_receiver):
    client, src, ask = remote_receiver
    creds = SessionCredentials.from_bytes(await ask("open", "r1", [4, 5, 9]))
    tx = client.open_transfer(creds)
    _from_engine_thread(lambda: [tx.write_layer(layer, [1, 2, 3]) for layer in range(GEO.num_layers)])
    await tx.finish(30)
    pool = await ask("dump")
    for layer in range(GEO.num_layers):
        for s, d in zip([1, 2, 3], [4, 5, 9]):
            a, b = GEO.offset(layer, s), GEO.offset(layer, d)
            assert pool[b : b + GEO.block_bytes] == src[a : a + GEO.block_bytes]
    assert await ask("close", "r1", [4, 5, 9])  # the blocks now hold canaries for their next owner
    stale = client.open_transfer(creds)  # the old credential, and the lane still caches its grant
    _from_engine_thread(lambda: stale.write_layer(0, [1, 2, 3]))
    with pytest.raises(TransferError, match="remote access error"):
        await stale.finish(30)
    after = await ask("dump")
    canary = bytes([CANARY]) * GEO.block_bytes
    for layer in range(GEO.num_layers):
        for b in [4, 5, 9]:
            assert after[GEO.offset(layer, b) : GEO.offset(layer, b) + GEO.block_bytes] == canary
    assert all(after[i] == CANARY for i in range(GEO.offset(0, 4)))  # nothing landed before the blocks either
    # the failed QP is replaced: the next request succeeds
    creds2 = SessionCredentials.from_bytes(await ask("open", "r2", [12]))
    tx2 = client.open_transfer(creds2)
    _from_engine_thread(lambda: [tx2.write_layer(layer, [7]) for layer in range(GEO.num_layers)])
    await tx2.finish(30)
    final = await ask("dump")
    assert final[GEO.offset(1, 12) : GEO.offset(1, 12) + GEO.block_bytes] == src[GEO.offset(1, 7) : GEO.offset(1, 8)]
