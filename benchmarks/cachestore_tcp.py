"""CacheStore tcp transport vs a plain socket sender/receiver, between two processes on 127.0.0.1.

Moves a realistic KV transfer (default 32 layers x 64 blocks x 64 KiB = 128 MiB)
with the real CacheStoreClient/CacheStoreServer into destination blocks laid out
`contiguous` (ids 0..N-1), `scattered` (37*i mod N: nothing coalesces) or
`random` (a seeded shuffle), and the same bytes with a plain socket pair sending
one buffer per layer (sendall / recv_into a preallocated buffer, the strongest
socket baseline), interleaved within each round so both see the same machine load; GB/s are medians
over the rounds and ratios the median of the per-round ratios, every round's GB/s in the JSON. Also
measures the latency of a small transfer (1 block x 32 layers), and the plain socket's for the
same bytes (one sendall per layer), interleaved.
Targets: >= 0.85x the plain socket on every layout; small transfer p50 <= 1.3 ms.
`--tls` adds a third sender, CacheStore over mutual TLS (a throwaway CA, as `pdserve up --cluster-tls`),
its rounds interleaved with the others: the cost of TLS is its GB/s and latency over plaintext's.

    python -m benchmarks.cachestore_tcp [--quick] [--layout contiguous|scattered|random|all] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, median_figures, pct
from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    LinkTLS,
    MemoryRegion,
    PoolGeometry,
    SessionCredentials,
)
from pdserve.node_runtime.cluster_tls import TLS_SERVER_NAME, make_throwaway

SECRET = b"bench"


def link_tls(files: tuple[str, str, str] | None) -> LinkTLS | None:
    return LinkTLS.from_files(*files, TLS_SERVER_NAME) if files else None


def receiver(conn, geo_args, transport: str = "tcp", tls_files: tuple[str, str, str] | None = None) -> None:
    """Child: a CacheStoreServer that opens sessions on request and reports completion."""
    geo = PoolGeometry(*geo_args)

    async def main() -> None:
        server = CacheStoreServer(
            MemoryRegion.from_buffer(bytearray(geo.total_bytes)),
            geo,
            transport=transport,
            secret=SECRET,
            tls=link_tls(tls_files),
        )
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


def plain_receiver(port_conn, sizes: list[tuple[int, int]]) -> None:
    """Child: accept one connection; for each (bytes, rounds), recv_into a preallocated buffer `rounds`
    times and ack each round with one byte."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(max(total for total, _ in sizes)))
    for total, rounds in sizes:
        for _ in range(rounds):
            got = 0
            while got < total:
                got += conn.recv_into(buf[got:total], min(total - got, 4 << 20))
            conn.sendall(b"k")
    conn.close()


class PlainSocket:
    """The baseline: one sendall per layer into a receiver process that acks each round (one warm-up
    round first, untimed, as CacheStore gets one). `small` rounds move one block per layer."""

    def __init__(self, geo: PoolGeometry, rounds: int, small_rounds: int) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.total, self.chunk = geo.total_bytes, geo.total_bytes // geo.num_layers
        self.small_total, self.small_chunk = geo.num_layers * geo.block_bytes, geo.block_bytes
        sizes = [(self.total, rounds + 1), (self.small_total, small_rounds)]
        self.proc = ctx.Process(target=plain_receiver, args=(child, sizes))
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", parent.recv()))
        self.data = memoryview(bytearray(os.urandom(1024)) * (self.total // 1024))
        self.round_seconds(self.total, self.chunk)  # warm-up

    def round_seconds(self, total: int, chunk: int) -> float:
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            self.sock.sendall(self.data[off : off + chunk])
        self.sock.recv(1)
        return time.perf_counter() - t0

    def round_gbps(self) -> float:
        return self.total / self.round_seconds(self.total, self.chunk) / 1e9

    def small_seconds(self) -> float:
        """1 block x num_layers: one sendall per layer, then the receiver's ack."""
        return self.round_seconds(self.small_total, self.small_chunk)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(30)


def layouts(num_blocks: int) -> dict[str, list[int]]:
    """Destination block ids per layout (the source blocks are always 0..N-1)."""
    return {
        "contiguous": list(range(num_blocks)),
        "scattered": [37 * i % num_blocks for i in range(num_blocks)],
        "random": random.Random(0).sample(range(num_blocks), num_blocks),
    }


class CacheStorePair:
    """A CacheStoreServer in a child process and a CacheStoreClient here (over mutual TLS with
    `tls_files`: cert, key, CA)."""

    def __init__(
        self, geo: PoolGeometry, transport: str = "tcp", tls_files: tuple[str, str, str] | None = None
    ) -> None:
        self.geo = geo
        ctx = mp.get_context("spawn")
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=receiver, args=(child, (geo.num_layers, geo.num_blocks, geo.block_bytes), transport, tls_files)
        )
        self.proc.start()
        self.parent.recv()
        src = bytearray(os.urandom(1024)) * (geo.total_bytes // 1024)
        self.client = CacheStoreClient(
            MemoryRegion.from_buffer(src), geo, transport=transport, secret=SECRET, tls=link_tls(tls_files)
        )
        self.n = 0

    async def transfer(self, src_blocks: list[int], dst_blocks: list[int]) -> float:
        loop = asyncio.get_running_loop()
        self.n += 1
        self.parent.send((f"t{self.n}", dst_blocks))
        creds = SessionCredentials.from_bytes(await loop.run_in_executor(None, self.parent.recv))
        t0 = time.perf_counter()
        tx = self.client.open_transfer(creds)
        for layer in range(self.geo.num_layers):
            tx.write_layer(layer, src_blocks)
        await tx.finish(60)
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.parent.send(None)
        await self.client.close()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()


async def cachestore_run(
    geo: PoolGeometry, rounds: int, small_rounds: int, transport: str = "tcp"
) -> tuple[float, list[float]]:
    """Best GB/s of contiguous transfers and the small-transfer latencies, CacheStore alone (the
    receiver in a child process)."""
    pair = CacheStorePair(geo, transport)
    blocks = list(range(geo.num_blocks))
    try:
        best = max([geo.total_bytes / await pair.transfer(blocks, blocks) / 1e9 for _ in range(rounds)], default=0.0)
        latencies = [await pair.transfer([i % geo.num_blocks], [i % geo.num_blocks]) for i in range(small_rounds)]
    finally:
        await pair.close()
    return best, latencies


async def run(
    geo: PoolGeometry, names: list[str], rounds: int, small_rounds: int, tls_files: tuple[str, str, str] | None
) -> tuple[list[dict[str, float]], dict[str, list[float]]]:
    """Per round, GB/s per layout and for the plain socket (interleaved within the round), and
    small-transfer latencies of CacheStore and of the plain socket (interleaved too); with
    `tls_files`, CacheStore over TLS in the same rounds (keys `<layout>_tls`, latencies under "tls").
    Every sender gets one untimed warm-up round (connection set-up, first touch of the destination
    pages)."""
    plain = PlainSocket(geo, rounds, small_rounds)
    pairs = {"": CacheStorePair(geo)}
    if tls_files:
        pairs["_tls"] = CacheStorePair(geo, tls_files=tls_files)
    src, dst_of = list(range(geo.num_blocks)), layouts(geo.num_blocks)
    per_round: list[dict[str, float]] = []
    latencies: dict[str, list[float]] = {"plain": [], **{suffix: [] for suffix in pairs}}
    try:
        for pair in pairs.values():
            await pair.transfer(src, src)  # warm-up
        for _ in range(rounds):
            got = {"plain": plain.round_gbps()}
            for name in names:
                for suffix, pair in pairs.items():
                    got[name + suffix] = geo.total_bytes / await pair.transfer(src, dst_of[name]) / 1e9
            per_round.append(got)
        for i in range(small_rounds):
            latencies["plain"].append(plain.small_seconds())
            for suffix, pair in pairs.items():
                latencies[suffix].append(await pair.transfer([i % geo.num_blocks], [(7 * i) % geo.num_blocks]))
    finally:
        plain.close()
        for pair in pairs.values():
            await pair.close()
    return per_round, latencies


def paired_median(per_round: list[dict[str, float]], arm: str, peer: str) -> float:
    """The median over the rounds of arm / peer, each ratio within one round (same machine load)."""
    return statistics.median(r[arm] / r[peer] for r in per_round)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 1 minute)")
    parser.add_argument("--layout", choices=["contiguous", "scattered", "random", "all"], default="all")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--tls", action="store_true", help="also CacheStore over mutual TLS (throwaway CA)")
    args = parser.parse_args()
    geo = PoolGeometry(args.layers, args.blocks, args.block_kib * 1024)
    rounds, small = (3, 50) if args.quick else (8, 300)
    names = ["contiguous", "scattered", "random"] if args.layout == "all" else [args.layout]
    with tempfile.TemporaryDirectory() as tmp:
        tls_files = tuple(map(str, make_throwaway(Path(tmp)))) if args.tls else None
        per_round, lat = asyncio.run(run(geo, names, rounds, small, tls_files))  # type: ignore[arg-type]
    lat_ms = [x * 1e3 for x in lat[""]]
    plain_lat_ms = [x * 1e3 for x in lat["plain"]]
    gbps = median_figures(per_round)
    ratio = {name: paired_median(per_round, name, "plain") for name in names}
    worst = min(names, key=lambda n: ratio[n])
    for name in names:
        print(
            f"{name:>10}: cachestore tcp {gbps[name]:.2f} GB/s, plain socket {gbps['plain']:.2f} GB/s (medians of "
            f"{rounds} rounds), paired ratio {ratio[name]:.2f}"
        )
    result = {
        "metric": "cachestore_tcp_gbps_" + ("worst_layout" if args.layout == "all" else args.layout),
        "value": round(gbps[worst], 3),
        "baseline": round(gbps["plain"], 3),
        "ratio": round(ratio[worst], 3),
        "ratio_is": "median over the rounds of CacheStore / plain socket GB/s, paired within each round",
        "target": 0.85,
        "worst_layout": worst,
        "transfer_mib": geo.total_bytes / 2**20,
        **{f"{n}_gbps": round(gbps[n], 3) for n in names},
        "small_transfer_p50_ms": round(statistics.median(lat_ms), 3),
        "small_transfer_p99_ms": round(pct(lat_ms, 0.99), 3),
        "small_transfer_p50_target_ms": 1.3,
        "small_transfer_plain_p50_ms": round(statistics.median(plain_lat_ms), 3),
        "small_transfer_plain_p99_ms": round(pct(plain_lat_ms, 0.99), 3),
        "rounds_gbps": [{k: round(v, 3) for k, v in r.items()} for r in per_round],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if args.tls:
        tls_ms = [x * 1e3 for x in lat["_tls"]]
        for name in names:
            tls_ratio = paired_median(per_round, name + "_tls", name)
            print(
                f"{name:>10}: cachestore over TLS {gbps[name + '_tls']:.2f} GB/s, {tls_ratio:.2f}x plaintext cachestore"
            )
            result[f"{name}_tls_gbps"] = round(gbps[name + "_tls"], 3)
            result[f"{name}_tls_over_plaintext"] = round(tls_ratio, 3)
        result["small_transfer_tls_p50_ms"] = round(statistics.median(tls_ms), 3)
        result["small_transfer_tls_p99_ms"] = round(pct(tls_ms, 0.99), 3)
    print(
        f"1 block x {args.layers} layers: cachestore p50 {result['small_transfer_p50_ms']} ms, "
        f"p99 {result['small_transfer_p99_ms']} ms; plain socket p50 {result['small_transfer_plain_p50_ms']} ms, "
        f"p99 {result['small_transfer_plain_p99_ms']} ms (load average {result['load_average_1m']})"
    )
    emit(result)


if __name__ == "__main__":
    main()
