"""Idle sockets and header drippers cannot starve the router of file descriptors: at nofile 1,024,
1,100 of them stay open against it while normal requests keep being served; and beyond the cap,
with every connection busy, a new one gets a 503 in the OpenAI error shape."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.router.http_limits import ConnectionLimits
from tests.e2e.cluster import ROOT
from tests.e2e.router_cluster import free_port

NOFILE = 1024
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def start_server(max_connections: int, header_timeout: float, first_delay: float = 0.0, body_timeout: float = 60.0):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.router.limits_server", str(port), str(max_connections), str(header_timeout)]
        + [str(first_delay), str(body_timeout)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE)),
    )
    seen = []
    for line in proc.stdout:  # warnings may come first
        seen.append(line)
        if line.startswith("READY"):  # lifespan startup: uvicorn binds right after it
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/version", timeout=2)
                    return proc, port
                except httpx.HTTPError:
                    time.sleep(0.1)
            break
    proc.kill()
    raise RuntimeError("limits server did not start:\n" + "".join(seen))


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this test process needs 4,096 file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_sockets_and_header_drippers_do_not_lock_out_clients(many_fds):
    proc, port = start_server(max_connections=4096, header_timeout=2.0)  # fitted to 1,024 - reserve
    attackers: list[socket.socket] = []
    try:
        for i in range(1100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:  # a dripper: a request line, then one header line now and then
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            attackers.append(s)
        served, end = 0, time.monotonic() + 6.0
        while time.monotonic() < end:  # the flood holds; normal clients keep getting answers
            for s in attackers[1::2][:50]:
                try:
                    s.sendall(b"X-Drip: 1\r\n")
                except OSError:
                    pass
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            served += 1
            time.sleep(0.2)
        assert served >= 10
        closed = 0
        for s in attackers:  # idle and dripping sockets were closed (head deadline or eviction)
            s.settimeout(5)
            try:
                closed += s.recv(1024) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1 if isinstance(sys.exc_info()[1], ConnectionResetError) else 0
        assert closed == len(attackers)
    finally:
        for s in attackers:
            s.close()
        stop(proc)


def test_beyond_the_cap_with_every_connection_busy_a_503_in_the_openai_shape():
    proc, port = start_server(max_connections=2, header_timeout=5.0, first_delay=3.0)
    busy = []
    try:
        for _ in range(2):  # two requests in progress: their tokens come only after 3 s
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            payload = json.dumps(BODY).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            s.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            busy.append(s)
        time.sleep(0.5)
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error" and "connections" in r.json()["error"]["message"]
        for s in busy:  # the busy ones were not cut
            s.settimeout(15)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in busy:
            s.close()
        stop(proc)


def test_limits_fit_the_fd_limit_and_refuse_bad_values():
    assert ConnectionLimits(max_connections=4096).for_fd_limit(1024).max_connections == 1024 - 256
    assert ConnectionLimits(max_connections=100).for_fd_limit(65536).max_connections == 100
    for bad in ({"header_timeout": 0}, {"keepalive_timeout": -1}, {"max_connections": 0}, {"body_timeout": 0}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)
