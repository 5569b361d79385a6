"""`pdserve up --num-prefill 0`: decode-only nodes behind the router serve the OpenAI API."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.e2e.router_cluster import free_port, metric_value
from tests.e2e.test_up import chat
from tests.e2e.up_process import start_up

pytestmark = pytest.mark.e2e


def test_up_without_prefill_nodes_serves_completions_and_chat():
    port, metrics = free_port(), free_port()
    up = start_up(["--port", str(port), "--num-prefill", "0", "--num-decode", "1", "--metrics-base-port", str(metrics)])
    proc, lines = up.proc, up.lines
    try:
        assert up.wait_up() and any("0 prefill, 1 decode" in x for x in lines), "\n".join(lines[-40:])
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
        assert metric_value(text, "pdserve_prefill_decisions_total", location="local") == 3, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
