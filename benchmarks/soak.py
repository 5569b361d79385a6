"""Soak: steady streaming load against `pdserve up` (2 prefill, 2 decode), the RSS of every process
sampled, and how much each one grew over the second half of the run.

After warm-up a process's memory should be flat: growth ratio = mean RSS over the last tenth of the
samples / mean RSS over the tenth around the midpoint. The worst ratio over all processes is the
headline (target <= 1.05).

    python -m benchmarks.soak [--quick] [--seconds 600] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import threading
import time

import httpx

from benchmarks.chaos import ERRORS, Up, one
from benchmarks.common import emit
from tests.e2e.router_cluster import free_port

WORDS = "the a lighthouse keeper river stone winter lamp city north quiet signal garden".split()


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None  # exited (a restart would show in the restart count)


def sample_forever(pids: dict[str, int], interval: float, stop: threading.Event, out: dict[str, list[int]]) -> None:
    while not stop.wait(interval):
        for name, pid in pids.items():
            value = rss_bytes(pid)
            if value is not None:
                out[name].append(value)


def growth(samples: list[int]) -> float:
    """Mean of the last tenth over the mean of the tenth around the midpoint (1.0 = flat)."""
    n = len(samples)
    w = max(1, n // 10)
    mid = samples[n // 2 - w // 2 : n // 2 - w // 2 + w]
    return statistics.mean(samples[-w:]) / statistics.mean(mid)


async def steady_load(base: str, seconds: float, concurrency: int, seed: int) -> dict[str, int]:
    """`concurrency` clients, each sending the next request as soon as its last one ends."""
    end = time.monotonic() + seconds
    counts = {"ok": 0, "error": 0}
    rng = random.Random(seed)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
            status, _ = await one(client, base, prompt, rng.randint(8, 48), None)
            counts["ok" if status == "ok" else "error"] += 1

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        await asyncio.gather(*[client_loop(client) for _ in range(concurrency)])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 minutes, 4 clients")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.concurrency = 120.0, 4
    import os

    up = Up(free_port(), {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        pids = {m[1]: int(m[2]) for x in up.lines if (m := re.search(r"^\s*(\S+): pid (\d+)", x))}
        pids["up"] = up.proc.pid
        samples: dict[str, list[int]] = {name: [] for name in pids}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_forever, args=(pids, args.interval, stop, samples), daemon=True)
        sampler.start()
        started = time.monotonic()
        counts = asyncio.run(steady_load(up.base, args.seconds, args.concurrency, args.seed))
        stop.set()
        sampler.join()
        elapsed = time.monotonic() - started
        restarts = up.count("restarting it on port")
    finally:
        up.stop()
    ratios = {name: round(growth(s), 4) for name, s in samples.items() if len(s) >= 4}
    emit(
        {
            "seconds": round(elapsed, 1),
            "concurrency": args.concurrency,
            "requests_ok": counts["ok"],
            "requests_failed": counts["error"],
            "restarts": restarts,
            "errors": sorted(set(ERRORS))[:5],
            "rss_mb_first_last": {n: [round(s[0] / 2**20), round(s[-1] / 2**20)] for n, s in samples.items() if s},
            "growth_last_half": ratios,
            "worst_growth": max(ratios.values()) if ratios else None,
        }
    )


if __name__ == "__main__":
    main()
