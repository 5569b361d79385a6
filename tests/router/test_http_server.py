"""serve_http's `on_listening`: called once the socket accepts connections (a READY line printed from
the app's startup handler came before uvicorn bound the port), and never when the port cannot be bound."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from tests.e2e.router_cluster import free_port
from tests.e2e.cluster import ROOT

SERVER = textwrap.dedent(
    """
    import os, signal, socket, sys
    from fastapi import FastAPI
    from pdserve.router.http_limits import ConnectionLimits
    from pdserve.router.http_server import serve_http

    port = int(sys.argv[1])
    app = FastAPI()

    @app.on_event("startup")
    async def startup() -> None:
        print("STARTUP", flush=True)

    def listening() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            print("LISTENING accepts", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    serve_http(app, "127.0.0.1", port, ConnectionLimits(), log_level="warning", graceful_timeout=1.0,
               on_listening=listening)
    """
)


def _serve(port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SERVER, str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_on_listening_runs_after_startup_once_the_port_accepts():
    run = _serve(free_port())
    # uvicorn shuts down on the SIGTERM, then re-raises it: the exit status is the signal's
    assert run.returncode == -15, run.stderr
    assert run.stdout.split() == ["STARTUP", "LISTENING", "accepts"], run.stdout + run.stderr


def test_a_port_that_cannot_be_bound_exits_non_zero_without_on_listening():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        run = _serve(held.getsockname()[1])
    assert run.returncode > 0, run.stderr  # uvicorn exits 3 (startup failure)
    assert "LISTENING" not in run.stdout, run.stdout


IDLE_SERVER = textwrap.dedent(
    """
    import sys
    from fastapi import FastAPI
    from pdserve.router.http_limits import ConnectionLimits
    from pdserve.router.http_server import serve_http

    port = int(sys.argv[1])
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    serve_http(app, "127.0.0.1", port, ConnectionLimits(), log_level="warning", graceful_timeout=1.0,
               on_listening=lambda: print("READY", flush=True))
    """
)


def test_an_idle_connection_outlives_the_clients_own_idle_limit():
    """With the default limits a connection left idle 6 s (past httpx's 5 s, which the openai package
    uses, and past the router's old 5 s) still takes the next request: the client, not the router,
    closes an idle connection, so a reused one is never closed under a request being written."""
    import http.client
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", IDLE_SERVER, str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/ping")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        local = conn.sock.getsockname()
        time.sleep(6.0)
        conn.request("GET", "/ping")
        second = conn.getresponse()
        assert second.status == 200 and second.read()
        assert conn.sock.getsockname() == local  # the same connection, not a new one
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
