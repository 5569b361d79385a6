"""A 3x overload burst on `pdserve up`'s defaults: does every request complete or get refused first?

Issue 54's burst: arrivals faster than the cluster serves them, for a while. First the cluster's
service rate is measured in the same run (requests completed per second with enough in flight to
keep every node busy: the baseline). Then Poisson arrivals at `--overload` times that rate (3x) run
for `--seconds`, each a streamed greedy completion of a ~300-token prompt and 32 tokens.

Every request must end one of two ways: it completes, or it is refused (503 with Retry-After, or
429) before any work, i.e. before its first byte of body. A request that failed after its stream
began, or with any other status, is a failure (target 0). The router's queue wait is read from its
`pdserve_router_queue_wait_seconds` histogram: its p99 (the upper edge of the bucket that holds it)
must stay within the configured `--capacity-wait` (30 s by default; the histogram has a bucket at
30.5 s, the bound with the slack of the last try). Reported ratio:
the burst's completed requests per second over the measured service rate (overload should not
collapse throughput; target >= 0.8).

    python -m benchmarks.overload_burst [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import NamedTuple

import httpx

from benchmarks.agent_overload import WORDS, counter
from benchmarks.common import emit
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


async def service_rate(port: int, in_flight: int, seconds: float, shape: Shape) -> float:
    """Requests completed per second with `in_flight` always outstanding (closed loop)."""
    rng = random.Random(1)
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


async def burst(port: int, rate: float, seconds: float, shape: Shape) -> tuple[list[str], float]:
    """Poisson arrivals at `rate` for `seconds`: each request's outcome, and the time until the
    last one ended."""
    rng = random.Random(2)
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


def queue_wait_p99(port: int) -> tuple[float, int]:
    """The upper edge of the histogram bucket holding the 99th percentile of queue waits, and the
    number of observations."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    buckets = []
    for line in text.splitlines():
        if line.startswith("pdserve_router_queue_wait_seconds_bucket"):
            edge = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(edge), float(line.split()[-1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    for edge, count in buckets:
        if count >= 0.99 * total:
            return edge, int(total)
    return float("nan"), int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 20 s burst after a 20 s rate measurement")
    parser.add_argument("--overload", type=float, default=3.0, help="arrival rate / measured service rate")
    parser.add_argument("--seconds", type=float, default=None, help="burst length (default 60; --quick 20)")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second instead of --overload x")
    parser.add_argument("--prompt-words", type=int, default=Shape().words, help="words per prompt (~1.15 tokens)")
    parser.add_argument("--max-tokens", type=int, default=Shape().max_tokens)
    args = parser.parse_args()
    shape = Shape(args.prompt_words, args.max_tokens)
    from pdserve.engine.builtin import default_model_dir

    seconds = args.seconds or (20.0 if args.quick else 60.0)
    port = free_port()
    server = start_pdserve(str(default_model_dir("bench")), port, ["--served-model-name", "bench"])
    try:
        rate = asyncio.run(service_rate(port, 16, 20.0 if args.quick else 45.0, shape))
        arrivals = args.rate if args.rate is not None else args.overload * rate
        outcomes, took = asyncio.run(burst(port, arrivals, seconds, shape))
        p99, waits = queue_wait_p99(port)
        retries = counter(port, "pdserve_router_retries_total")
        migrations = counter(port, "pdserve_router_migrations_total")
    finally:
        stop(server)
    completed = outcomes.count("completed")
    refused = outcomes.count("refused")
    failures = [o for o in outcomes if o.startswith("failed")]
    burst_rate = completed / took
    print(
        f"service rate {rate:.2f} req/s; arrivals at {arrivals:.2f} req/s for {seconds:.0f} s: "
        f"{len(outcomes)} requests, {completed} completed, {refused} refused before any work, {len(failures)} failed "
        f"({sorted(set(failures))[:3]}); queue wait p99 <= {p99:g} s over {waits}; {retries:.0f} retries, "
        f"{migrations:.0f} migrations; all ended after {took:.0f} s",
        file=sys.stderr,
    )
    emit(
        {
            "metric": "failed_requests_in_overload_burst",
            "value": len(failures),
            "baseline": round(rate, 3),
            "baseline_is": "measured service rate, req/s (closed loop, 16 in flight)",
            "ratio": round(burst_rate / rate, 3),
            "ratio_is": "completed req/s over the whole burst (until the last request ended) / service rate",
            "target": 0,
            "requests": len(outcomes),
            "completed": completed,
            "refused_before_work": refused,
            "queue_wait_p99_s": p99,
            "queue_wait_bound_s": CAPACITY_WAIT,
            "retries": retries,
            "migrations": migrations,
            "arrival_rate": round(arrivals, 3),
            "prompt_words": shape.words,
            "max_tokens": shape.max_tokens,
            "burst_seconds": seconds,
        }
    )


if __name__ == "__main__":
    main()
