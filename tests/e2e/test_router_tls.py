"""The router serves HTTPS when given a certificate (self-signed here, made with openssl)."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest

from tests.e2e.cluster import start, stop
from tests.e2e.router_cluster import free_port

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a test certificate")
def test_router_speaks_tls(tmp_path, tiny_model_dir):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    port = free_port()
    # no nodes behind it: /health must answer 503 in the OpenAI error shape, over TLS
    router = start(
        "router",
        [
            "--port",
            str(port),
            "--model",
            str(tiny_model_dir),
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
            "--prefill",
            "127.0.0.1:9",
            "--decode",
            "127.0.0.1:9",
        ],
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=False, timeout=2)
                break
            except httpx.ConnectError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # plain HTTP is not served
    finally:
        stop(router)
