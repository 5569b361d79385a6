"""A slow-body drip is cut off (issue 24): the whole body must arrive within --body-timeout of the
request head, or the client gets a 408 in the OpenAI error shape and the connection is closed;
a large body sent at a normal pace is served as before."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.router.test_connection_limits import start_server, stop

BODY_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def server():
    proc, port = start_server(max_connections=64, header_timeout=5.0, body_timeout=BODY_TIMEOUT)
    try:
        yield port
    finally:
        stop(proc)


def read_response(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """Everything the server sends within `within` seconds, and whether it closed the connection."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return data, True
    except (TimeoutError, ConnectionResetError):
        return data, False


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_dripped_body_gets_408_and_is_closed(server, framing):
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()
    sock = socket.create_connection(("127.0.0.1", server), timeout=10)
    stop_drip = threading.Event()
    length = f"Content-Length: {len(body)}" if framing == "content-length" else "Transfer-Encoding: chunked"
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode()
    )

    def drip() -> None:  # one byte every 0.3 s: the body would take far longer than the deadline
        for i in range(len(body)):
            if stop_drip.wait(0.3):
                return
            piece = body[i : i + 1]
            try:
                sock.sendall(piece if framing == "content-length" else b"1\r\n" + piece + b"\r\n")
            except OSError:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    started = time.monotonic()
    dripper.start()
    try:
        data, closed = read_response(sock, within=BODY_TIMEOUT + 20)
        elapsed = time.monotonic() - started
    finally:
        stop_drip.set()
        sock.close()
        dripper.join(5)
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert closed, "the server must close the connection after the 408"
    assert elapsed >= BODY_TIMEOUT * 0.9  # not before the deadline


def test_large_body_at_a_normal_pace_is_served(server):
    """3 MiB (JSON whitespace around a normal request) sent in 48 pieces over about a second."""
    pad = b" " * (3 << 20)
    body = b'{"model": "m", "prompt": "hello",' + pad + b'"max_tokens": 4}'

    def paced():
        step = 1 << 16
        for i in range(0, len(body), step):
            yield body[i : i + step]
            time.sleep(0.02)

    r = httpx.post(
        f"http://127.0.0.1:{server}/v1/completions",
        content=paced(),
        headers={"Content-Type": "application/json", "Content-Length": str(len(body))},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_server_still_serves_after_the_drips(server):
    r = httpx.post(
        f"http://127.0.0.1:{server}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200, r.text
