"""Chaos: streaming requests against `pdserve up` (2 prefill, 2 decode) under a seeded fault schedule.

Faults: CacheStore write failures at p=0.05 (the test-only $PDSERVE_FAULT_WRITE_FAIL_RATE hook of
the prefill senders), one decode SIGKILL, one prefill SIGKILL, one decode SIGSTOP for 10 s, and
client cancels. Each fault fires when a seeded fraction of the requests has finished, so the
schedule does not depend on the machine's speed. The baseline is the same requests on an undisturbed
`pdserve up` in the same run; greedy decoding makes every text reproducible.

    python -m benchmarks.chaos [--quick] [--seed 0] [--transport tcp|rdma]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from benchmarks.cluster_procs import ROOT
from benchmarks.common import emit
from tests.e2e.router_cluster import free_port

MODEL = "pdserve-tiny"
ERRORS: list[str] = []
"""Messages of the errors clients saw (printed grouped, to tell clean failures apart)."""


class Up:
    """`pdserve up` as a child process; its output is kept for the pids and the restart log."""

    def __init__(self, port: int, env: dict[str, str], transport: str = "tcp") -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        cmd = ["up", "--num-prefill", "2", "--num-decode", "2", "--port", str(port), "--transport", transport]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *cmd],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("pdserve up did not start:\n" + "\n".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("Ctrl-C stops"):
                self.ready.set()
        self.ready.set()

    def pid(self, name: str) -> int:
        return int(next(m[1] for x in self.lines if (m := re.search(rf"{name}: pid (\d+)", x))))

    def count(self, text: str) -> int:
        return sum(text in x for x in self.lines)

    def nodes(self) -> list[dict]:
        return httpx.get(f"{self.base}/v1/cluster", timeout=10).json()["nodes"]

    def counter(self, name: str) -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith((name + " ", name + "{")))

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


async def one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, cancel_after: int | None):
    """('ok'|'error'|'cancelled', text). An error is an HTTP error or an in-band error chunk."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, chunks = "", 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                await r.aread()
                ERRORS.append(f"HTTP {r.status_code}: {r.text[:200]}")
                return ("error", text) if "error" in r.json() else ("bad-error", text)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    ERRORS.append(chunk["error"]["message"])
                    return "error", text
                text += "".join(c["text"] for c in chunk["choices"])
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return "cancelled", text  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        ERRORS.append(f"{type(e).__name__}: {e}")
        return "error", text
    return "ok", text


async def run_load(
    up: Up, prompts: list[str], max_tokens: int, concurrency: int, cancels: dict[int, int], on_progress=None
) -> list[tuple[str, str]]:
    done = 0
    sem = asyncio.Semaphore(concurrency)

    async def task(i: int):
        nonlocal done
        async with sem:
            result = await one(client, up.base, prompts[i], max_tokens, cancels.get(i))
        done += 1
        if on_progress:
            on_progress(done)
        return result

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        return await asyncio.gather(*[task(i) for i in range(len(prompts))])


class Schedule:
    """Fires the faults when seeded fractions of the requests have finished."""

    def __init__(self, up: Up, total: int, rng: random.Random, stop_seconds: float) -> None:
        self.up = up
        self.stop_seconds = stop_seconds
        at = sorted(rng.uniform(0.1, 0.6) for _ in range(3))
        self.events = [
            (int(at[0] * total), "kill decode-0"),
            (int(at[1] * total), "kill prefill-1"),
            (int(at[2] * total), "stop decode-1"),
        ]
        self.log: list[str] = []
        self.threads: list[threading.Thread] = []

    def progress(self, done: int) -> None:
        while self.events and done >= self.events[0][0]:
            _, what = self.events.pop(0)
            t = threading.Thread(target=self._fire, args=(what, done), daemon=True)
            t.start()
            self.threads.append(t)

    def _fire(self, what: str, done: int) -> None:
        verb, name = what.split()
        self.log.append(f"{what} after {done} requests")
        if verb == "kill":
            os.kill(self.up.pid(name), signal.SIGKILL)
            return
        pid = self.up.pid(name)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(self.stop_seconds)
        os.kill(pid, signal.SIGCONT)
        self.log.append(f"continued {name}")


def is_wrong(result: tuple[str, str], expected: str) -> bool:
    """A finished text that differs, an error not in the OpenAI shape, or any text that is not a prefix
    of the undisturbed run's (an error or a cancel may stop early, never say something else)."""
    status, text = result
    if status == "ok":
        return text != expected
    return status == "bad-error" or not expected.startswith(text)


def settle(up: Up, timeout: float = 120.0) -> tuple[int, bool]:
    """Wait until every node is usable with every block free; return (blocks not free, all usable)."""
    deadline = time.monotonic() + timeout
    leaked, usable = -1, False
    while time.monotonic() < deadline:
        try:
            nodes = up.nodes()
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        leaked = sum(n["total_blocks"] - n["free_blocks"] for n in nodes)
        usable = len(nodes) == 4 and all(n["usable"] for n in nodes)
        if usable and leaked == 0:
            break
        time.sleep(0.5)
    return leaked, usable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 requests of 48 tokens, 15 cancels, 5 s pause")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default 48 quick, 128 full)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--fail-rate", type=float, default=0.05, help="CacheStore write failure probability")
    ap.add_argument(
        "--transport",
        default=os.environ.get("PDSERVE_TRANSPORT", "tcp"),
        help="KV transport of the cluster ($PDSERVE_TRANSPORT; rdma runs on the emulated device with "
        "PDSERVE_RDMA_EMULATOR=1)",
    )
    args = ap.parse_args()
    total = args.requests or (60 if args.quick else 200)
    num_cancels, stop_seconds = (15, 5.0) if args.quick else (50, 10.0)
    args.max_tokens = args.max_tokens or (48 if args.quick else 128)
    rng = random.Random(args.seed)
    prompts = [f"Chaos request {i}: the {rng.choice(['river', 'tower', 'forest', 'harbor'])}" for i in range(total)]
    cancels = {i: rng.randint(1, 8) for i in rng.sample(range(total), num_cancels)}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in ("PDSERVE_API_KEY", "PDSERVE_API_KEYS", "PDSERVE_FAULT_WRITE_FAIL_RATE"):
        env.pop(k, None)

    up = Up(free_port(), env, args.transport)  # baseline: the same requests, no faults
    try:
        t0 = time.monotonic()
        reference = asyncio.run(run_load(up, prompts, args.max_tokens, args.concurrency, {}))
        baseline_seconds = time.monotonic() - t0
    finally:
        up.stop()
    base_ok = sum(s == "ok" for s, _ in reference)

    chaos_env = {**env, "PDSERVE_FAULT_WRITE_FAIL_RATE": str(args.fail_rate), "PDSERVE_FAULT_SEED": str(args.seed)}
    up = Up(free_port(), chaos_env, args.transport)
    try:
        schedule = Schedule(up, total, rng, stop_seconds)
        t0 = time.monotonic()
        results = asyncio.run(run_load(up, prompts, args.max_tokens, args.concurrency, cancels, schedule.progress))
        chaos_seconds = time.monotonic() - t0
        for t in schedule.threads:
            t.join()
        leaked, all_usable = settle(up)
        final = asyncio.run(run_load(up, prompts[:1], args.max_tokens, 1, {}))[0]
        restarts = up.count("restarting it on port")
        retries, migrations = up.counter("pdserve_router_retries_total"), up.counter("pdserve_router_migrations_total")
        alive = up.proc.poll() is None
    finally:
        exit_code = up.stop()

    counted = [i for i in range(total) if i not in cancels and reference[i][0] == "ok"]
    identical = sum(results[i] == reference[i] for i in counted)
    clean_errors = sum(results[i][0] == "error" and reference[i][1].startswith(results[i][1]) for i in counted)
    wrong = sum(is_wrong(results[i], reference[i][1]) for i in range(total) if reference[i][0] == "ok")
    cancelled = sum(results[i][0] == "cancelled" for i in cancels)
    still_serving = alive and final == reference[0]
    value = identical / len(counted) if counted else 0.0
    baseline = base_ok / total
    print(f"schedule: {'; '.join(schedule.log)}")
    for message in sorted(set(ERRORS)):
        print(f"error x{ERRORS.count(message)}: {message}")
    print(f"baseline (no faults): {base_ok}/{total} ok in {baseline_seconds:.1f} s")
    print(
        f"chaos: {identical}/{len(counted)} identical, {clean_errors} clean errors, {wrong} wrong, "
        f"{cancelled}/{len(cancels)} cancelled, {leaked} blocks not free at the end, {restarts} restarts by up, "
        f"still serving: {still_serving}, router retries {retries:.0f}, migrations {migrations:.0f}, "
        f"in {chaos_seconds:.1f} s (machine shared with other work)"
    )
    emit(
        {
            "metric": "chaos_completed_identical_fraction",
            "value": round(value, 4),
            "baseline": round(baseline, 4),
            "ratio": round(value / baseline, 4) if baseline else None,
            "target": 0.95,
            "requests": total,
            "counted": len(counted),
            "identical": identical,
            "clean_errors": clean_errors,
            "wrong_outputs": wrong,
            "cancels": len(cancels),
            "blocks_not_free": leaked,
            "all_nodes_usable": all_usable,
            "restarts_by_up": restarts,
            "still_serving": still_serving,
            "router_retries": retries,
            "router_migrations": migrations,
            "up_exit_code": exit_code,
            "schedule": schedule.log,
            "fail_rate": args.fail_rate,
            "transport": args.transport,
            "seed": args.seed,
            "met": wrong == 0 and leaked == 0 and value >= 0.95 and still_serving,
        }
    )


if __name__ == "__main__":
    main()
