"""`pdserve up --num-prefill 0`: decode-only nodes behind the router serve the OpenAI API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.e2e.cluster import ROOT
from tests.e2e.router_cluster import free_port
from tests.e2e.test_up import chat

pytestmark = pytest.mark.e2e


def test_up_without_prefill_nodes_serves_completions_and_chat():
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--num-prefill", "0", "--num-decode", "1"]
        + ["--metrics-base-port", str(metrics)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "pdserve is up" in line:
                up.set()
        up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert up.wait(180) and any("0 prefill, 1 decode" in x for x in lines), "\n".join(lines[-40:])
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        r = chat(port)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        again = chat(port)  # the same conversation again: served from the decode node's prefix cache
        assert again.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"]["content"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
        local = [x for x in text.splitlines() if x.startswith("pdserve_prefill_decisions_total") and "local" in x]
        assert local and float(local[0].rsplit(" ", 1)[1]) == 3, local
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
