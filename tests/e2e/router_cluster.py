"""A whole cluster for API tests: node processes from tests.e2e.cluster plus a router process."""

from __future__ import annotations

import socket
import time

import httpx

from tests.e2e.cluster import Cluster, Proc, start, start_cluster, stop

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the first sample of `name` in Prometheus text whose labels include `labels`
    (0 if none)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_router(cluster: Cluster, model: str, extra: list[str] | None = None) -> tuple[Proc, str]:
    port = free_port()
    router = start(
        "router",
        [
            "--port",
            str(port),
            "--model",
            model,
            "--served-model-name",
            "pdserve-tiny",
            "--cluster-secret",
            cluster.secret,
            "--api-key",
            API_KEY,
            "--prefill",
            ",".join(p.address for p in cluster.prefills),
            "--decode",
            ",".join(d.address for d in cluster.decodes),
            *(extra or []),
        ],
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return router, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(router)
    raise RuntimeError(f"router never became healthy:\n{router.tail()}")


def start_full(model: str, num_prefill: int = 1, num_decode: int = 2, extra: list[str] | None = None):
    cluster = start_cluster(num_prefill, num_decode, model=model, extra=extra)
    try:
        router, base = start_router(cluster, model)
    except Exception:
        cluster.stop()
        raise
    return cluster, router, base
