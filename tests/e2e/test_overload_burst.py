"""Overload degrades, it does not fail (issue 54), with real processes.

A prefill + decode cluster on the `bench` model gets a burst of long prompts all at once, far more
than it serves in the router's (shortened) `--capacity-wait`. Every request must either complete or
be refused with a 503 status and Retry-After before any work (streams too: never a 200 whose
stream carries the error); no request is retried; the queue wait of every request stays within the
bound; and afterwards no KV block is held. The backlog bound is what keeps the excess at the router:
without it every request would go to the nodes and wait there.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.engine.builtin import default_model_dir
from tests.e2e.cluster import start_cluster, stop
from tests.e2e.router_cluster import API_KEY, start_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAPACITY_WAIT = 1.0
LIMITS = ["--capacity-wait", str(CAPACITY_WAIT), "--max-prefill-backlog", "1"]


def _request(base: str, prompt: str, stream: bool) -> str:
    """ "completed", "refused" (503 + Retry-After before the response started) or "failed: why"."""
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=300) as r:
        if r.status_code == 503:
            r.read()
            return "refused" if "retry-after" in r.headers else "failed: 503 without Retry-After"
        if r.status_code != 200:
            return f"failed: HTTP {r.status_code}"
        if not stream:
            return "completed" if json.loads(r.read())["choices"][0]["finish_reason"] else "failed: unfinished"
        for line in r.iter_lines():
            if line.startswith("data: {") and '"error"' in line:
                return f"failed mid-stream: {line[:200]}"
        return "completed"


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_burst_completes_or_is_refused_before_any_work():
    model = str(default_model_dir("bench"))
    rng = random.Random(3)
    words = "lighthouse keeper stairs evening lamp ship harbour storm night sea wave rock".split()
    prompts = [" ".join(rng.choice(words) for _ in range(800)) for _ in range(48)]
    cluster = start_cluster(1, 1, model=model)
    router = None
    try:
        router, base = start_router(cluster, model, LIMITS)
        assert _request(base, prompts[0], False) == "completed"  # the router measures the prefill rate
        with ThreadPoolExecutor(len(prompts)) as pool:
            outcomes = list(pool.map(lambda i: _request(base, prompts[i], i % 2 == 0), range(len(prompts))))
        failures = [o for o in outcomes if o.startswith("failed")]
        assert not failures, failures
        assert "refused" in outcomes and "completed" in outcomes, outcomes  # it was overloaded, and served
        metrics = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
        assert _metric(metrics, "pdserve_router_retries_total") == 0
        waits = _metric(metrics, "pdserve_router_queue_wait_seconds_count")
        within = _metric(metrics, f'pdserve_router_queue_wait_seconds_bucket{{le="{CAPACITY_WAIT + 0.5}"')
        assert waits > 0 and within == waits, metrics
        deadline = time.monotonic() + 30  # every block is back once the last stream has ended
        while True:
            nodes = httpx.get(f"{base}/v1/cluster", headers=AUTH, timeout=5).json()["nodes"]
            if all(n["free_blocks"] == n["total_blocks"] for n in nodes):
                break
            assert time.monotonic() < deadline, nodes
            time.sleep(0.5)
    finally:
        if router is not None:
            stop(router)
        cluster.stop()
