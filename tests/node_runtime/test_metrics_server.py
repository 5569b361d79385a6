"""The node's /metrics keeps vLLM's colon names whatever format the scraper asks for."""

from __future__ import annotations

import socket

import httpx
from prometheus_client import CollectorRegistry, Gauge

from pdserve.node_runtime.metrics_server import serve_metrics

# What Prometheus 2.x sends: OpenMetrics preferred, which prometheus_client would answer with
# `vllm_num_requests_running` sample lines.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_colon_names_survive_an_openmetrics_accept_header():
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry).labels("m").set(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve_metrics("127.0.0.1", port, registry)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'vllm:num_requests_running{model_name="m"} 3.0' in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=10).status_code == 404
    finally:
        server.shutdown()
        server.server_close()
