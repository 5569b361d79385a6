"""CacheStore tcp transport vs a plain socket sender/receiver, between two processes on 127.0.0.1.

Moves a realistic KV transfer (default 32 layers x 64 blocks x 64 KiB = 128 MiB)
with the real CacheStoreClient/CacheStoreServer, then the same bytes with a
plain socket pair (sendall / recv_into a preallocated buffer), and measures the
latency of a small transfer (1 block x 32 layers). Target: >= 85% of the plain
socket's GB/s.

    python benchmarks/cachestore_tcp.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit  # noqa: E402
from cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials  # noqa: E402

SECRET = b"bench"


def receiver(conn, geo_args) -> None:
    """Child: a CacheStoreServer that opens sessions on request and reports completion."""
    geo = PoolGeometry(*geo_args)

    async def main() -> None:
        server = CacheStoreServer(MemoryRegion.from_buffer(bytearray(geo.total_bytes)), geo, transport="tcp",
                                  secret=SECRET)
        await server.start()
        conn.send(server.endpoint)
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg is None:
                break
            rid, blocks = msg
            creds = server.open_session(rid, blocks, timeout=60)
            conn.send(creds.to_bytes())
            await server.get_session(rid).wait_complete(60)
            server.close_session(rid)
        await server.stop()

    asyncio.run(main())


def plain_receiver(port_conn, total: int, rounds: int) -> None:
    """Child: accept one connection, recv_into a preallocated buffer `rounds` times, ack each."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(total))
    for _ in range(rounds):
        got = 0
        while got < total:
            got += conn.recv_into(buf[got:], min(total - got, 4 << 20))
        conn.sendall(b"k")
    conn.close()


def plain_socket_gbps(total: int, rounds: int, chunk: int) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=plain_receiver, args=(child, total, rounds))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", parent.recv()))
    data = memoryview(bytearray(os.urandom(1024)) * (total // 1024))
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            sock.sendall(data[off:off + chunk])
        sock.recv(1)
        best = max(best, total / (time.perf_counter() - t0) / 1e9)
    sock.close()
    proc.join()
    return best


async def cachestore_run(geo: PoolGeometry, rounds: int, small_rounds: int) -> tuple[float, list[float]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, (geo.num_layers, geo.num_blocks, geo.block_bytes)))
    proc.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, parent.recv)
    src = bytearray(os.urandom(1024)) * (geo.total_bytes // 1024)
    client = CacheStoreClient(MemoryRegion.from_buffer(src), geo, transport="tcp", secret=SECRET)

    async def transfer(rid: str, blocks: list[int]) -> float:
        parent.send((rid, blocks))
        creds = SessionCredentials.from_bytes(await loop.run_in_executor(None, parent.recv))
        t0 = time.perf_counter()
        tx = client.open_transfer(creds)
        for layer in range(geo.num_layers):
            tx.write_layer(layer, blocks)
        await tx.finish(60)
        return time.perf_counter() - t0

    all_blocks = list(range(geo.num_blocks))
    try:
        best = 0.0
        for i in range(rounds):
            best = max(best, geo.total_bytes / await transfer(f"big{i}", all_blocks) / 1e9)
        latencies = [await transfer(f"small{i}", [i % geo.num_blocks]) for i in range(small_rounds)]
        parent.send(None)
    finally:
        await client.close()
        await loop.run_in_executor(None, proc.join, 30)
        if proc.is_alive():
            proc.kill()
    return best, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 1 minute)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=64)
    args = parser.parse_args()
    geo = PoolGeometry(args.layers, args.blocks, args.block_kib * 1024)
    rounds, small = (3, 50) if args.quick else (8, 300)
    plain = plain_socket_gbps(geo.total_bytes, rounds, chunk=geo.block_bytes * args.blocks)
    ours, lat = asyncio.run(cachestore_run(geo, rounds, small))
    lat_ms = sorted(x * 1e3 for x in lat)
    result = {
        "metric": "cachestore_tcp_gbps", "value": round(ours, 3), "baseline": round(plain, 3),
        "ratio": round(ours / plain, 3), "target": 0.85,
        "transfer_mib": geo.total_bytes / 2**20,
        "small_transfer_p50_ms": round(statistics.median(lat_ms), 3),
        "small_transfer_p99_ms": round(lat_ms[min(len(lat_ms) - 1, int(len(lat_ms) * 0.99))], 3),
    }
    print(f"cachestore tcp: {ours:.2f} GB/s, plain socket: {plain:.2f} GB/s, ratio {ours / plain:.2f}; "
          f"1 block x {args.layers} layers: p50 {result['small_transfer_p50_ms']} ms, "
          f"p99 {result['small_transfer_p99_ms']} ms")
    emit(result)


if __name__ == "__main__":
    main()
