"""Requests uvicorn cannot parse (bad Content-Length) get a 400 in the OpenAI shape, over a real socket."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.app import create_app
from pdserve.router.http_protocol import OpenAIErrorH11Protocol
from pdserve.router.serving import Server
from tests.e2e.router_cluster import free_port


@pytest.fixture
def server_port(tiny_model_dir, make_client):
    _, _, FakeCluster = make_client
    app = create_app(Server(FakeCluster([5]), Tokenizer(tiny_model_dir), "m", 128))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", http=OpenAIErrorH11Protocol, lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize(
    "header", [b"Content-Length: abc", b"Content-Length: -5", b"Content-Length: 3\r\nContent-Length: 4"]
)
def test_unparsable_content_length_is_an_openai_400(server_port, header):
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + header + b"\r\n\r\n{}"
        )
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, response
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "Content-Length" in error["message"]
