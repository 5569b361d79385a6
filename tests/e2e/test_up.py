"""`pdserve up` brings a cluster up, answers the README's curl request, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.cluster import ROOT
from tests.e2e.router_cluster import free_port

pytestmark = pytest.mark.e2e


def test_up_serves_and_stops_on_sigint():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
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
        assert up.wait(180) and any("pdserve is up" in line for line in lines), "\n".join(lines[-40:])
        assert f"http://127.0.0.1:{port}/v1" in "\n".join(lines)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert "pdserve stopped." in lines[-1]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
