"""`pdserve up` brings a cluster up, answers the README's curl request, heals a killed node, and stops on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = pytest.mark.e2e


def chat(port: int) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        timeout=60,
        json={
            "model": "pdserve-tiny",
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
            "temperature": 0,
        },
    )


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def usable_decodes(port: int) -> int:
    try:
        nodes = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=5).json()["nodes"]
    except httpx.HTTPError:
        return 0
    return sum(1 for n in nodes if n["role"] == "decode" and n["usable"])


def test_up_serves_heals_a_killed_node_and_stops_on_sigint():
    port = free_port()
    up = start_up(["--port", str(port)])
    proc, lines = up.proc, up.lines
    try:
        assert up.wait_up(), "\n".join(lines[-40:])
        assert f"http://127.0.0.1:{port}/v1" in "\n".join(lines)
        r = chat(port)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        expected = r.json()["choices"][0]["message"]["content"]

        # SIGKILL a decode node: `up` restarts it on the same port and the router uses it again
        pid = int(next(re.search(r"decode-0: pid (\d+), port (\d+)", x) for x in lines if "decode-0: pid" in x)[1])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: any("decode-0 is back" in x for x in lines), 180, "decode-0 to be restarted")
        assert any("decode-0 exited with -9; restarting it on port" in x for x in lines), "\n".join(lines[-40:])
        wait_for(lambda: usable_decodes(port) == 2, 60, "both decode nodes to be usable again")
        for _ in range(4):  # the balancer spreads these over both decode nodes
            r = chat(port)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert "pdserve stopped (1 restarts)." in lines[-1]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:  # SIGKILL: the nodes have PR_SET_PDEATHSIG, they go with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
