"""Router HTTP metrics: bounded route labels, model_name label, /version, process collectors."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

import pdserve
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.app import create_app
from pdserve.router.http_metrics import OTHER_ROUTE, HttpMetrics
from pdserve.router.serving import Server


class IdleCluster:
    """Enough of a Cluster for requests that never reach a node."""

    def is_healthy(self) -> bool:
        return True

    def snapshot(self) -> list:
        return []


def _series(registry: CollectorRegistry, name: str) -> list:
    return [s for m in registry.collect() for s in m.samples if s.name == name]


def _app(tiny_model_dir, registry: CollectorRegistry):
    server = Server(IdleCluster(), Tokenizer(tiny_model_dir), "m", 128)
    return create_app(server, registry=registry)


def test_20000_unknown_paths_make_one_series(tiny_model_dir):
    registry = CollectorRegistry()
    app = _app(tiny_model_dir, registry)
    metrics = HttpMetrics(CollectorRegistry(), "m")
    for i in range(20_000):
        scope = {"type": "http", "path": f"/scan/{i}", "method": "GET", "root_path": ""}
        metrics.observe(app.router.routes, scope, 404)
    samples = [s for m in metrics.requests.collect() for s in m.samples if s.name.endswith("_total")]
    assert len(samples) == 1
    assert samples[0].labels == {"model_name": "m", "route": OTHER_ROUTE, "status": "404"}
    assert samples[0].value == 20_000


async def test_route_label_is_the_template_through_the_app(tiny_model_dir):
    registry = CollectorRegistry()
    app = _app(tiny_model_dir, registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for i in range(200):
            assert (await client.get(f"/no/such/{i}")).status_code == 404
        assert (await client.get("/health")).status_code == 200
        version = await client.get("/version")
        assert version.status_code == 200 and version.json() == {"version": pdserve.__version__}
        assert (await client.get("/v1/completions")).status_code == 405
    labels = {
        (s.labels["route"], s.labels["status"]): s.value for s in _series(registry, "pdserve_router_requests_total")
    }
    assert labels == {
        ("other", "404"): 200,
        ("/health", "200"): 1,
        ("/version", "200"): 1,
        ("/v1/completions", "405"): 1,
    }
    assert all(s.labels["model_name"] == "m" for s in _series(registry, "pdserve_router_requests_total"))
