"""Bit-exact transfers over the transports that run here (tcp, local)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random

from pdserve.cachestore import CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials, coalesce
from tests.cachestore.helpers import SECRET, block, pools, sender_process, untouched_outside

GEO = PoolGeometry(num_layers=6, num_blocks=64, block_bytes=2048)


async def _send(server, client, rid: str, src_blocks, dst_blocks, layers) -> None:
    creds = server.open_session(rid, dst_blocks, GEO.num_layers, timeout=10)
    tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
    for layer in layers:
        tx.write_layer(layer, src_blocks)
    await tx.finish(10)
    session = server.get_session(rid)
    await session.wait_complete(5)
    server.close_session(rid)
    await session.wait_safe_to_reuse(5)


async def test_several_layers_out_of_order_bit_exact(pair):
    server, client, src, dst = pair
    src_blocks, dst_blocks = [3, 4, 5, 9, 10, 40], [7, 8, 20, 21, 22, 1]
    layers = [4, 0, 5, 2, 1, 3]
    await _send(server, client, "r", src_blocks, dst_blocks, layers)
    for layer in range(GEO.num_layers):
        for s, d in zip(src_blocks, dst_blocks):
            assert block(dst, GEO, layer, d) == block(src, GEO, layer, s)
    assert untouched_outside(dst, GEO, {(layer, d) for layer in range(GEO.num_layers) for d in dst_blocks})


async def test_fifty_concurrent_sessions_share_the_connection_pool(pair):
    server, client, src, dst = pair
    rng = random.Random(3)
    dst_perm = rng.sample(range(GEO.num_blocks), GEO.num_blocks)
    jobs = []
    for i in range(50):
        d = [dst_perm[i]]
        s = [rng.randrange(GEO.num_blocks)]
        jobs.append((f"r{i}", s, d))
    layers = list(range(GEO.num_layers))
    await asyncio.gather(*[_send(server, client, rid, s, d, rng.sample(layers, len(layers))) for rid, s, d in jobs])
    for _, s, d in jobs:
        for layer in layers:
            assert block(dst, GEO, layer, d[0]) == block(src, GEO, layer, s[0])
    if server.active_transport == "tcp":
        assert len(client._channels) == 1


def test_coalescing_groups_runs_consecutive_on_both_sides():
    runs = coalesce([1, 2, 3, 7, 8, 10], [5, 6, 7, 9, 11, 12])
    assert [(r.src_block, r.dst_block, r.count) for r in runs] == [(1, 5, 3), (7, 9, 1), (8, 11, 1), (10, 12, 1)]


async def test_sender_in_another_process():
    src, dst = pools(GEO, seed=11)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET)
    await server.start()
    try:
        creds = server.open_session("x", [30, 31, 32, 50], GEO.num_layers, timeout=30)
        proc = mp.get_context("spawn").Process(
            target=sender_process,
            args=(
                creds.to_bytes(),
                (GEO.num_layers, GEO.num_blocks, GEO.block_bytes),
                [0, 1, 2, 3],
                [5, 3, 1, 0, 2, 4],
                11,
            ),
        )
        proc.start()
        await server.get_session("x").wait_complete(30)
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
        assert proc.exitcode == 0
        for layer in range(GEO.num_layers):
            for s, d in zip([0, 1, 2, 3], [30, 31, 32, 50]):
                assert block(dst, GEO, layer, d) == block(src, GEO, layer, s)
        server.close_session("x")
    finally:
        await server.stop()
    assert server.num_sessions == 0
