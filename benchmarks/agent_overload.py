"""An agent-like workload on `pdserve up` with its defaults: does a loaded cluster fail requests?

Issue 54's workload: 24 sessions, each with its own ~1,500-token context, revisited round-robin for 4
turns (each turn appends the reply and a new step), 32-token greedy replies, 4 requests in flight, on
the `bench` model with `--kv-cache-memory 192MiB` per node and every liveness limit at its default.
Baseline: the same sessions run one request at a time (an unloaded cluster), in the same process
lifetime of a fresh `pdserve up`. Reported: failed requests under load (target 0), those of the
unloaded run, the share of loaded replies whose text equals the unloaded run's (ratio; target 1.0),
and the router's hung and migration counts.

    python -m benchmarks.agent_overload [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import httpx

from benchmarks.common import emit
from benchmarks.multiturn_servers import start_pdserve, stop
from tests.e2e.router_cluster import free_port

WORDS = (
    "the lighthouse keeper climbed stairs evening lamp ship harbour storm night sea agent tool call file code".split()
)


async def run_sessions(port: int, sessions: int, turns: int, in_flight: int) -> tuple[dict, int]:
    """Every session's turns, `in_flight` requests at a time: ({(session, turn): text or None}, failed)."""
    rng = random.Random(0)
    history = [" ".join(rng.choice(WORDS) for _ in range(1300)) for _ in range(sessions)]
    texts: dict = {}
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient() as client:

        async def one(s: int, t: int) -> None:
            prompt = history[s] + f"\nStep {t}: continue."
            body = {"model": "bench", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            async with gate:
                try:
                    r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=900)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
                except (httpx.HTTPError, KeyError, ValueError):
                    text = None
            texts[(s, t)] = text
            history[s] = prompt + (text or "")

        for t in range(turns):  # round-robin over the sessions, one turn each per round
            await asyncio.gather(*[one(s, t) for s in range(sessions)])
    return texts, sum(v is None for v in texts.values())


def counter(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def blocks_free_after(port: int, wait: float = 30.0) -> bool:
    """Whether every node's KV blocks are all free again (within `wait` s of the last reply)."""
    deadline = time.monotonic() + wait
    while True:
        nodes = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=10).json()["nodes"]
        if all(n["free_blocks"] == n["total_blocks"] for n in nodes):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def measure(model: str, sessions: int, turns: int, in_flight: int) -> tuple[dict, int, float, float, bool]:
    """One fresh `pdserve up` (defaults, 192 MiB of KV per node): texts, failures, retries, migrations,
    and whether every block was free afterwards."""
    port = free_port()
    server = start_pdserve(model, port, ["--kv-cache-memory", "192MiB", "--served-model-name", "bench"])
    try:
        texts, failed = asyncio.run(run_sessions(port, sessions, turns, in_flight))
        return (
            texts,
            failed,
            counter(port, "pdserve_router_retries_total"),
            counter(port, "pdserve_router_migrations_total"),
            blocks_free_after(port),
        )
    finally:
        stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 sessions x 2 turns")
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    from pdserve.engine.builtin import default_model_dir

    model = str(default_model_dir("bench"))
    sessions, turns = (8, 2) if args.quick else (24, 4)
    start = time.monotonic()
    loaded, failed, retries, migrations, free_after = measure(model, sessions, turns, args.in_flight)
    loaded_s = time.monotonic() - start
    unloaded, unloaded_failed, _, _, _ = measure(model, sessions, turns, 1)
    same = sum(loaded[k] is not None and loaded[k] == unloaded[k] for k in loaded)
    print(
        f"loaded ({args.in_flight} in flight): {len(loaded) - failed}/{len(loaded)} completed in {loaded_s:.0f} s, "
        f"{retries:.0f} retries, {migrations:.0f} migrations; unloaded: {len(unloaded) - unloaded_failed}/"
        f"{len(unloaded)} completed; identical text {same}/{len(loaded)}; blocks free after: {free_after}",
        file=sys.stderr,
    )
    emit(
        {
            "metric": "failed_requests_under_load",
            "value": failed,
            "baseline": unloaded_failed,
            "ratio": round(same / len(loaded), 3),
            "ratio_is": "loaded replies whose text equals the unloaded run's",
            "target": 0,
            "requests": len(loaded),
            "in_flight": args.in_flight,
            "retries": retries,
            "migrations": migrations,
            "blocks_free_after": free_after,
            "loaded_seconds": round(loaded_s, 1),
        }
    )


if __name__ == "__main__":
    main()
