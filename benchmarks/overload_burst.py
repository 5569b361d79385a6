"""A 3x overload burst on `pdserve up`'s defaults: does every request complete or get refused first?

Issue 54's burst: arrivals faster than the cluster serves them, for a while. The cluster's service
rate is measured in the same run (requests completed per second with enough in flight to keep every
node busy: the baseline), and Poisson arrivals at `--overload` times the last measured rate (3x) run
for `--seconds`, each a streamed greedy completion of a ~300-token prompt and 32 tokens. The two
alternate over `--rounds` rounds on one cluster (service first in even rounds, the burst first in
odd ones, at the previous round's rate); every round's figures are in the JSON.

Every request must end one of two ways: it completes, or it is refused (503 with Retry-After, or
429) before any work, i.e. before its first byte of body. A request that failed after its stream
began, or with any other status, is a failure (target 0). The router's queue wait is read from its
`pdserve_router_queue_wait_seconds` histogram over each burst: its p99 (the upper edge of the bucket
that holds it) must stay within the configured `--capacity-wait` (30 s by default; the histogram has a bucket at
30.5 s, the bound with the slack of the last try). Reported ratio:
the median over the rounds of the burst's completed requests per second over the same round's
service rate (overload should not collapse throughput; target >= 0.8); value: the failures of all
rounds together.

    python -m benchmarks.overload_burst [--quick] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from typing import NamedTuple

import httpx

from benchmarks.agent_overload import WORDS, counter
from benchmarks.common import add_rounds_arg, alternate, emit
from benchmarks.multiturn_servers import start_pdserve, stop
from tests.e2e.router_cluster import free_port

CAPACITY_WAIT = 30.0 + 0.5
"""The router's default --capacity-wait, with the slack of its last try: the bound a new request
waits for room (pdserve.router.admission.BOUND_SLACK)."""


class Shape(NamedTuple):
    """The requests: prompt words (~1.15 tokens each) and greedy tokens to generate."""

    words: int = 260
    max_tokens: int = 32


async def one(client: httpx.AsyncClient, port: int, rng: random.Random, shape: Shape) -> str:
    """One streamed request: "completed", "refused" (503 with Retry-After or 429, before any body),
    or "failed: why"."""
    text = " ".join(rng.choice(WORDS) for _ in range(shape.words)) + " Continue:"
    body = {"model": "bench", "prompt": text, "max_tokens": shape.max_tokens, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=900) as r:
            if r.status_code in (429, 503):
                await r.aread()
                if r.status_code == 503 and "retry-after" not in r.headers:
                    return "failed: 503 without Retry-After"
                return "refused"
            if r.status_code != 200:
                return f"failed: HTTP {r.status_code}"
            finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"failed mid-stream: {event['error'].get('message', '')[:120]}"
                finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
            return "completed" if finished else "failed: stream ended unfinished"
    except httpx.HTTPError as e:
        return f"failed: {type(e).__name__}"


async def service_rate(port: int, in_flight: int, seconds: float, shape: Shape, seed: int) -> float:
    """Requests completed per second with `in_flight` always outstanding (closed loop)."""
    rng = random.Random(seed)
    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient() as client:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                if await one(client, port, rng, shape) == "completed":
                    done += 1

        start = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(in_flight)])
        return done / (time.monotonic() - start)


async def burst(port: int, rate: float, seconds: float, shape: Shape, seed: int) -> tuple[list[str], float]:
    """Poisson arrivals at `rate` for `seconds`: each request's outcome, and the time until the
    last one ended."""
    rng = random.Random(seed)
    tasks = []
    start = time.monotonic()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t - start >= seconds:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(client, port, rng, shape)))
        outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.monotonic() - start


def queue_wait_buckets(port: int) -> dict[float, float]:
    """The router's cumulative queue-wait histogram: bucket upper edge -> observations up to it."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    buckets = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_queue_wait_seconds_bucket"):
            edge = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(edge)] = float(line.split()[-1])
    return buckets


def queue_wait_p99(before: dict[float, float], after: dict[float, float]) -> tuple[float, int]:
    """The upper edge of the bucket holding the 99th percentile of the queue waits observed between
    two readings of the histogram, and how many there were (0 s over 0 when none was)."""
    delta = sorted((edge, count - before.get(edge, 0.0)) for edge, count in after.items())
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return 0.0, 0  # no request waited for room
    for edge, count in delta:
        if count >= 0.99 * total:
            return edge, int(total)
    return float("nan"), int(total)


class Counters(NamedTuple):
    """The router's retry and migration counters at one moment."""

    retries: float
    migrations: float

    @classmethod
    def read(cls, port: int) -> Counters:
        return cls(counter(port, "pdserve_router_retries_total"), counter(port, "pdserve_router_migrations_total"))


def burst_round(port: int, arrivals: float, seconds: float, shape: Shape, seed: int) -> dict:
    """One burst and what it did: outcomes, completion rate, the queue waits and router counters it moved."""
    buckets, counters = queue_wait_buckets(port), Counters.read(port)
    outcomes, took = asyncio.run(burst(port, arrivals, seconds, shape, seed))
    p99, waits = queue_wait_p99(buckets, queue_wait_buckets(port))
    after = Counters.read(port)
    failures = [o for o in outcomes if o.startswith("failed")]
    return {
        "arrival_rate": round(arrivals, 3),
        "requests": len(outcomes),
        "completed": outcomes.count("completed"),
        "refused_before_work": outcomes.count("refused"),
        "failed": len(failures),
        "failures": sorted(set(failures))[:3],
        "completed_per_s": round(outcomes.count("completed") / took, 3),
        "took_s": round(took, 1),
        "queue_wait_p99_s": p99,
        "queue_waits": waits,
        "retries": after.retries - counters.retries,
        "migrations": after.migrations - counters.migrations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s bursts and 20 s rate measurements")
    parser.add_argument("--overload", type=float, default=3.0, help="arrival rate / measured service rate")
    parser.add_argument("--seconds", type=float, default=None, help="burst length (default 60; --quick 20)")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second instead of --overload x")
    parser.add_argument("--prompt-words", type=int, default=Shape().words, help="words per prompt (~1.15 tokens)")
    parser.add_argument("--max-tokens", type=int, default=Shape().max_tokens)
    add_rounds_arg(parser)
    args = parser.parse_args()
    shape = Shape(args.prompt_words, args.max_tokens)
    from pdserve.engine.builtin import default_model_dir

    seconds = args.seconds or (20.0 if args.quick else 60.0)
    measure_seconds = 20.0 if args.quick else 45.0
    rates: list[float] = []
    seeds = itertools.count(1)  # a new seed per measurement: no round replays prompts an earlier one cached

    def service() -> dict:
        rates.append(asyncio.run(service_rate(port, 16, measure_seconds, shape, next(seeds))))
        return {"service_rate": round(rates[-1], 3)}

    def overload() -> dict:
        arrivals = args.rate if args.rate is not None else args.overload * rates[-1]
        return burst_round(port, arrivals, seconds, shape, next(seeds))

    port = free_port()
    server = start_pdserve(str(default_model_dir("bench")), port, ["--served-model-name", "bench"])
    try:
        runs = alternate({"service": service, "burst": overload}, args.rounds)
    finally:
        stop(server)
    bursts = runs.of("burst")
    paired = [
        b["completed_per_s"] / r["service"]["service_rate"]
        for r, b in zip(runs.rounds, bursts)
        if r["service"]["service_rate"]
    ]
    for r, b in zip(runs.rounds, bursts):
        print(
            f"service rate {r['service']['service_rate']:.2f} req/s; arrivals at {b['arrival_rate']:.2f} req/s for "
            f"{seconds:.0f} s: {b['requests']} requests, {b['completed']} completed, {b['refused_before_work']} "
            f"refused before any work, {b['failed']} failed ({b['failures']}); queue wait p99 <= "
            f"{b['queue_wait_p99_s']:g} s over {b['queue_waits']}; {b['retries']:.0f} retries, {b['migrations']:.0f} "
            f"migrations; all ended after {b['took_s']:.0f} s",
            file=sys.stderr,
        )
    emit(
        {
            "metric": "failed_requests_in_overload_burst",
            "value": sum(b["failed"] for b in bursts),
            "value_is": "failed requests, all rounds' bursts together",
            "baseline": round(statistics.median(r["service_rate"] for r in runs.of("service")), 3),
            "baseline_is": "measured service rate, req/s (closed loop, 16 in flight), median over the rounds",
            "ratio": round(statistics.median(paired), 3) if paired else None,
            "ratio_is": "median over the rounds of: completed req/s over the whole burst (until the last request "
            "ended) / that round's service rate",
            "target": 0,
            "requests": sum(b["requests"] for b in bursts),
            "completed": sum(b["completed"] for b in bursts),
            "refused_before_work": sum(b["refused_before_work"] for b in bursts),
            "queue_wait_p99_s": max(b["queue_wait_p99_s"] for b in bursts),
            "queue_wait_p99_is": "the worst round's",
            "queue_wait_bound_s": CAPACITY_WAIT,
            "prompt_words": shape.words,
            "max_tokens": shape.max_tokens,
            "burst_seconds": seconds,
            "rounds": runs.rounds,
        }
    )


if __name__ == "__main__":
    main()
