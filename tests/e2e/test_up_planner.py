"""`pdserve up --planner slo` end to end on the built-in model: under requests that miss an
unmeetable TTFT SLO the planner asks for a second prefill node and `up` starts it on a spare slot;
once the requests stop, the node is drained and stopped again and the cluster still serves. Every
request sent while the node joined got its answer, and the members file is gone after Ctrl-C."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def wait_for(up, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in up.lines):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in:\n" + "\n".join(up.lines[-40:]))


def test_up_starts_a_node_under_slo_misses_and_drains_it_when_they_stop(monkeypatch):
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="up-planner-test-")
    monkeypatch.setenv("TMPDIR", tmp)
    planner = ["--planner", "slo", "--ttft-slo", "0.001", "--tpot-slo", "5", "--planner-max-nodes", "3"]
    planner += ["--planner-interval", "1", "--planner-window", "2", "--planner-dwell", "2"]
    up = start_up(["--num-prefill", "1", "--num-decode", "1", "--num-threads", "1", "--port", str(port), *planner])
    statuses: list[int] = []
    sending = threading.Event()
    sending.set()

    def send() -> None:
        body = {"model": "pdserve-tiny", "prompt": "Hello there, a prompt for the prefill node", "max_tokens": 4}
        while sending.is_set():
            statuses.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code)
            time.sleep(0.1)

    try:
        assert up.wait_up(), "\n".join(up.lines)
        assert len(list(Path(tmp).glob("pdserve-members-*/members.json"))) == 1
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for(up, "planner: prefill-1 serves")
        sending.clear()
        sender.join(60)
        wait_for(up, "planner: draining prefill-1")
        wait_for(up, "planner: prefill-1 stopped")
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        assert statuses and set(statuses) == {200}, statuses
    finally:
        sending.clear()
        os.killpg(up.proc.pid, signal.SIGINT)
        up.proc.wait(60)
    assert not list(Path(tmp).glob("pdserve-members-*"))
