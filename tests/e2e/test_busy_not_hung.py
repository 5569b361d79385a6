"""Busy is not hung, with real processes (issue 54).

A prefill + decode cluster on the `bench` model, its nodes slowed by a CPU hog on every core and
prompts of ~1,500 tokens (each prefill step runs for seconds), behind a router whose liveness
limits are *tighter* than the defaults (hung after 2 s, probes within 0.5 s): no node is ever
declared hung or migrated away from, every request completes with the text an idle cluster gives,
and no block is left held. Then one node is SIGSTOPped and is declared hung within
`--hung-after` + 3 s.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.engine.builtin import default_model_dir
from tests.e2e.router_cluster import API_KEY, start_router
from tests.e2e.cluster import start_cluster, stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HUNG_AFTER = 2.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIGHT = ["--hung-after", str(HUNG_AFTER), "--health-timeout", "0.5"]


def _hog(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def _complete(base: str, prompt: str) -> httpx.Response:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=300)


def _nodes(base: str) -> list[dict]:
    return httpx.get(f"{base}/v1/cluster", headers=AUTH, timeout=5).json()["nodes"]


def _prompts(n: int) -> list[str]:
    rng = random.Random(5)
    words = "lighthouse keeper stairs evening lamp ship harbour storm night sea wave rock".split()
    return [" ".join(rng.choice(words) for _ in range(1200)) for _ in range(n)]


def test_a_slow_node_is_never_declared_hung_and_a_stopped_one_is():
    model = str(default_model_dir("bench"))
    prompts = _prompts(4)
    cluster = start_cluster(1, 1, model=model, extra=["--max-num-batched-tokens", "2048"])
    router = None
    hogs: list[multiprocessing.Process] = []
    try:
        router, base = start_router(cluster, model, TIGHT)
        expected = [_complete(base, p).json()["choices"][0]["text"] for p in prompts[:2]]  # idle machine
        stop_at = time.monotonic() + 240
        hogs = [multiprocessing.Process(target=_hog, args=(stop_at,), daemon=True) for _ in range(os.cpu_count() or 2)]
        for h in hogs:
            h.start()
        hung_seen: list[dict] = []
        with ThreadPoolExecutor(5) as pool:
            pending = [pool.submit(_complete, base, p) for p in prompts]
            progress = []
            while not all(f.done() for f in pending):  # the router's view, sampled while they run
                nodes = _nodes(base)
                hung_seen += [n for n in nodes if n["hung"]]
                progress.append(sum(n["progress"] for n in nodes))
                time.sleep(0.25)
            answers = [f.result() for f in pending]
        for h in hogs:
            h.terminate()
        assert not hung_seen, hung_seen
        assert progress[-1] > progress[0]  # the nodes reported the layers they computed
        assert [a.status_code for a in answers] == [200] * len(prompts), [a.text[:200] for a in answers]
        assert [a.json()["choices"][0]["text"] for a in answers[:2]] == expected
        log = "\n".join(router.lines)
        assert "missed a health check" not in log and "migrating" not in log, log[-3000:]
        metrics = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
        assert 'pdserve_router_retries_total{model_name="pdserve-tiny"} 0.0' in metrics, metrics

        # a stopped node is hung: within --hung-after + 3 s of its first missed probe
        decode = cluster.decodes[0]
        decode.popen.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            while not any(n["hung"] for n in _nodes(base) if n["role"] == "decode"):
                assert time.monotonic() - start < HUNG_AFTER + 3, "the stopped node was not declared hung in time"
                time.sleep(0.1)
            assert not [n for n in _nodes(base) if n["role"] == "decode" and n["usable"]]
        finally:
            decode.popen.send_signal(signal.SIGCONT)
    finally:
        for h in hogs:
            if h.is_alive():
                h.terminate()
        if router is not None:
            stop(router)
        cluster.stop()
