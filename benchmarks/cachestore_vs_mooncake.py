"""CacheStore tcp vs Mooncake Transfer Engine (TCP, batch_transfer_sync_write) vs a plain socket.

Same transfer as benchmarks/cachestore_tcp.py (32 layers x 64 blocks x 64 KiB by default), the same
destination layouts (contiguous, scattered, random), each side in its own receiver process over
127.0.0.1, interleaved within each round (GB/s: medians over the rounds; ratios: the median of
the per-round ratios; every round's GB/s in the JSON). Mooncake gets one batch per transfer holding every (layer, run)
entry, runs coalesced exactly as CacheStore coalesces them. Also the 1 block x 32 layers latency.
Mooncake is not a dependency of this project: install it elsewhere (`pip install
mooncake-transfer-engine-non-cuda`, Debian libibverbs1) and pass --mooncake-site; it binds 0.0.0.0,
so run this inside `unshare --net` with `ip link set lo up`. Exits 2 if Mooncake cannot be imported.

    unshare --net sh -c 'ip link set lo up; python -m benchmarks.cachestore_vs_mooncake --mooncake-site DIR [--quick]'
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time

from benchmarks.cachestore_tcp import CacheStorePair, PlainSocket, layouts, paired_median
from benchmarks.common import emit, median_figures, pct
from pdserve.cachestore import PoolGeometry
from pdserve.cachestore.geometry import coalesce


def _engine(site: str | None):
    if site:
        sys.path.append(site)
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    return te


def mooncake_receiver(conn, total: int, site: str | None) -> None:
    """Child: a Mooncake engine with one registered buffer of `total` bytes; waits until told to stop."""
    te = _engine(site)
    buf = bytearray(total)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if te.register_memory(addr, total) != 0:
        raise RuntimeError("Mooncake register_memory failed on the receiver")
    conn.send((f"127.0.0.1:{te.get_rpc_port()}", addr))
    conn.recv()


class MooncakePair:
    def __init__(self, geo: PoolGeometry, site: str | None) -> None:
        self.geo = geo
        ctx = mp.get_context("spawn")
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=mooncake_receiver, args=(child, geo.total_bytes, site))
        self.proc.start()
        self.target, self.dst_base = self.parent.recv()
        self.te = _engine(site)
        self.src = bytearray(os.urandom(1024)) * (geo.total_bytes // 1024)
        self.src_base = ctypes.addressof(ctypes.c_char.from_buffer(self.src))
        if self.te.register_memory(self.src_base, geo.total_bytes) != 0:
            raise RuntimeError("Mooncake register_memory failed on the sender")

    def transfer(self, src_blocks: list[int], dst_blocks: list[int]) -> float:
        geo, srcs, dsts, lens = self.geo, [], [], []
        runs = coalesce(src_blocks, dst_blocks)
        t0 = time.perf_counter()
        for layer in range(geo.num_layers):
            for r in runs:
                srcs.append(self.src_base + geo.offset(layer, r.src_block))
                dsts.append(self.dst_base + geo.offset(layer, r.dst_block))
                lens.append(r.count * geo.block_bytes)
        if self.te.batch_transfer_sync_write(self.target, srcs, dsts, lens) != 0:
            raise RuntimeError("Mooncake batch_transfer_sync_write failed")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.parent.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


async def run(
    geo: PoolGeometry, rounds: int, small_rounds: int, site: str | None
) -> tuple[list[str], list[dict[str, float]], dict[str, list[float]]]:
    """Per round, GB/s of the plain socket and of CacheStore and Mooncake per layout (interleaved
    within the round), and the small-transfer latencies of all three (interleaved too)."""
    names = ["contiguous", "scattered", "random"]
    plain, pair, mc = PlainSocket(geo, rounds, small_rounds), CacheStorePair(geo), MooncakePair(geo, site)
    src, dst_of = list(range(geo.num_blocks)), layouts(geo.num_blocks)
    per_round: list[dict[str, float]] = []
    lat: dict[str, list[float]] = {"cachestore": [], "mooncake": [], "plain": []}
    try:
        await pair.transfer(src, src)  # warm-up
        mc.transfer(src, src)
        for _ in range(rounds):
            got = {"plain": plain.round_gbps()}
            for name in names:
                got[f"cachestore_{name}"] = geo.total_bytes / await pair.transfer(src, dst_of[name]) / 1e9
                got[f"mooncake_{name}"] = geo.total_bytes / mc.transfer(src, dst_of[name]) / 1e9
            per_round.append(got)
        for i in range(small_rounds):
            s, d = [i % geo.num_blocks], [(7 * i) % geo.num_blocks]
            lat["plain"].append(plain.small_seconds())
            lat["cachestore"].append(await pair.transfer(s, d))
            lat["mooncake"].append(mc.transfer(s, d))
    finally:
        plain.close()
        await pair.close()
        mc.close()
    return names, per_round, lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 1 minute)")
    parser.add_argument("--mooncake-site", default=None, help="site-packages directory holding mooncake")
    args = parser.parse_args()
    try:
        if args.mooncake_site:
            sys.path.append(args.mooncake_site)
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        print(f"Mooncake Transfer Engine is not installed ({e}); nothing compared.", file=sys.stderr)
        sys.exit(2)
    geo = PoolGeometry(32, 64, 64 * 1024)
    rounds, small = (3, 50) if args.quick else (8, 300)
    names, per_round, lat = asyncio.run(run(geo, rounds, small, args.mooncake_site))
    gbps = median_figures(per_round)
    ratio = {name: paired_median(per_round, f"cachestore_{name}", f"mooncake_{name}") for name in names}
    result: dict = {}
    for name in names:
        cs, m = gbps[f"cachestore_{name}"], gbps[f"mooncake_{name}"]
        print(
            f"{name:>10}: cachestore {cs:.2f} GB/s, mooncake {m:.2f} GB/s, plain socket {gbps['plain']:.2f} GB/s "
            f"(medians of {rounds} rounds), cachestore/mooncake {ratio[name]:.2f} (paired)"
        )
        result.update({f"cachestore_{name}_gbps": round(cs, 3), f"mooncake_{name}_gbps": round(m, 3)})
        result[f"{name}_ratio"] = round(ratio[name], 3)
    for side, xs in lat.items():
        ms = [x * 1e3 for x in xs]
        p50, p99 = round(statistics.median(ms), 3), round(pct(ms, 0.99), 3)
        result[f"{side}_small_p50_ms"], result[f"{side}_small_p99_ms"] = p50, p99
        print(f"1 block x 32 layers, {side}: p50 {p50} ms, p99 {p99} ms")
    worst = min(names, key=lambda n: ratio[n])
    emit(
        {
            "metric": "cachestore_vs_mooncake_worst_layout_ratio",
            "value": round(ratio[worst], 3),
            "baseline": "mooncake TE tcp batch_transfer_sync_write",
            "ratio": round(ratio[worst], 3),
            "ratio_is": "median over the rounds of CacheStore / Mooncake GB/s, paired within each round",
            "target": 1.5,
            "worst_layout": worst,
            "plain_gbps": round(gbps["plain"], 3),
            **result,
            "rounds_gbps": [{k: round(v, 3) for k, v in r.items()} for r in per_round],
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    )


if __name__ == "__main__":
    main()
