"""A running `pdserve up` (1 prefill, 1 decode, router) scraped by a real Prometheus on loopback.

Shared by the scrape tests (tests/deploy/test_prometheus_scrape.py, test_vllm_series.py): starting
a cluster and a Prometheus takes a minute, so one pair serves a whole module. Targets carry the
namespace/pod labels the Prometheus Operator would attach, so the alerts and dashboards match.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.test_monitoring import RULE_FILE
from tests.e2e.router_cluster import API_KEY, free_port

PODS = ("prefill-0", "decode-0", "router-0")


@dataclass
class ScrapedCluster:
    """Where the cluster and its Prometheus listen."""

    prometheus: str
    """Prometheus base URL."""
    http: str
    """The router's base URL."""
    targets: dict[str, str]
    """pod name -> host:port of its /metrics."""

    def query(self, expr: str) -> list:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, (expr, r.text)
        return r.json()["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of a scalar-like query (a sum), None when it has no data."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.http, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})


def wait_for(cond, what: str, timeout: float = 120.0, interval: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def _wait_banner(up: subprocess.Popen, timeout: float = 240.0) -> None:
    """Read `pdserve up`'s output until its ready banner (model build + three processes on a loaded machine)."""
    lines: list[str] = []
    found = threading.Event()

    def reader() -> None:
        assert up.stdout is not None
        for line in up.stdout:  # keep draining after the banner, or the pipe fills and blocks `up`
            lines.append(line)
            if line.startswith("pdserve is up"):
                found.set()

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.is_set():
        assert up.poll() is None, "pdserve up exited:\n" + "".join(lines[-40:])
        assert time.monotonic() < deadline, "pdserve up not ready:\n" + "".join(lines[-40:])
        time.sleep(0.5)


def _prometheus_config(tmp: Path, targets: dict[str, str], scrape_interval: str) -> Path:
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(yaml.safe_load(RULE_FILE.read_text())["spec"]))
    config = tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {
                        "job_name": "pdserve",
                        "static_configs": [
                            {"targets": [t], "labels": {"namespace": "pd", "pod": pod}} for pod, t in targets.items()
                        ],
                    }
                ],
            }
        )
    )
    return config


def _stop(proc: subprocess.Popen | None, group: bool = False) -> None:
    if proc is None or proc.poll() is not None:
        return
    if group:
        os.killpg(proc.pid, signal.SIGTERM)  # `up` stops its nodes and router
    else:
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)


@contextmanager
def scraped_cluster(tmp: Path, model_dir: Path, scrape_interval: str = "1s") -> Iterator[ScrapedCluster]:
    """Start the cluster and Prometheus, wait until every target is up, yield, stop both."""
    if subprocess.run(["which", "prometheus", "promtool"], capture_output=True).returncode != 0:
        pytest.skip("prometheus/promtool not installed (scripts/install_ops_tools.sh installs them)")
    up = prom = None
    try:
        http_port, metrics_base = free_port(), free_port()
        while metrics_base + 1 == http_port:  # the two node metrics ports follow metrics_base
            metrics_base = free_port()
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir)]
            + ["--num-prefill", "1", "--num-decode", "1", "--port", str(http_port)]
            # short prompts would prefill on the decode node: the KV-transfer series need bytes on the wire
            + ["--local-prefill-max-tokens", "0", "--metrics-base-port", str(metrics_base), "--api-key", API_KEY],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        _wait_banner(up)
        ports = (metrics_base, metrics_base + 1, http_port)
        targets = {pod: f"127.0.0.1:{port}" for pod, port in zip(PODS, ports)}
        prom_port = free_port()
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={_prometheus_config(tmp, targets, scrape_interval)}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        cluster = ScrapedCluster(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{http_port}", targets)

        def all_up() -> bool:
            try:
                return sum(float(r["value"][1]) for r in cluster.query("up")) == len(targets)
            except (httpx.HTTPError, AssertionError):
                return False

        wait_for(all_up, "every target up")
        yield cluster
    finally:
        _stop(prom)
        _stop(up, group=True)
