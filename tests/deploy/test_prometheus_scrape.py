"""A real Prometheus scrapes a running `pdserve up` on loopback (slow; needs the apt `prometheus` package).

It checks what an SRE relies on: every process's /metrics passes `promtool check metrics`,
every target is up, and after a few requests every recording rule of the monitoring
component and every dashboard query returns data.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
import pytest
import yaml

from tests.deploy.test_monitoring import RULE_FILE, dashboard_exprs
from tests.e2e.router_cluster import API_KEY, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
# Series that exist only after something went wrong (no rejected frame in a healthy run).
ONLY_ON_FAILURE = ("pdserve_cachestore_rejected_frames",)


def _query(base: str, expr: str) -> list:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(1)
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


def test_prometheus_scrapes_every_process_and_every_query_has_data(tmp_path, tiny_model_dir):
    if subprocess.run(["which", "prometheus", "promtool"], capture_output=True).returncode != 0:
        pytest.skip("prometheus/promtool not installed (scripts/install_ops_tools.sh installs them)")
    up = None
    prom = None
    try:
        http_port, metrics_base = free_port(), free_port()
        while metrics_base + 1 == http_port:  # the two node metrics ports follow metrics_base
            metrics_base = free_port()
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "up",
                "--model",
                str(tiny_model_dir),
                "--num-prefill",
                "1",
                "--num-decode",
                "1",
                "--local-prefill-max-tokens",  # short prompts would prefill on the decode node: the
                "0",  # KV-transfer queries need bytes on the wire
                "--port",
                str(http_port),
                "--metrics-base-port",
                str(metrics_base),
                "--api-key",
                API_KEY,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        _wait_banner(up)
        targets = [f"127.0.0.1:{p}" for p in (metrics_base, metrics_base + 1, http_port)]

        for target in targets:  # the exposition itself passes promtool's linter
            body = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read()
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
            assert lint.returncode == 0, (target, lint.stdout.decode() + lint.stderr.decode())

        rules = tmp_path / "rules.yaml"
        rules.write_text(yaml.safe_dump(yaml.safe_load(RULE_FILE.read_text())["spec"]))
        config = tmp_path / "prometheus.yml"
        # namespace/pod labels as the Prometheus Operator would attach them, so the rules and dashboard match.
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {
                            "job_name": "pdserve",
                            "static_configs": [
                                {"targets": [t], "labels": {"namespace": "pd", "pod": name}}
                                for t, name in zip(targets, ("prefill-0", "decode-0", "router-0"))
                            ],
                        }
                    ],
                }
            )
        )
        prom_port = free_port()
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path}/data",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{prom_port}"

        def all_up() -> bool:
            try:
                return sum(float(r["value"][1]) for r in _query(base, "up")) == len(targets)
            except (httpx.HTTPError, AssertionError):
                return False

        _wait(all_up, "every target up")

        with httpx.Client(
            base_url=f"http://127.0.0.1:{http_port}", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as client:
            for i in range(4):
                r = client.post(
                    "/v1/completions",
                    json={"model": "pdserve-tiny", "prompt": f"hello {i}", "max_tokens": 6, "stream": i % 2 == 0},
                )
                assert r.status_code == 200, r.text
        time.sleep(1)

        recorded = [
            r["record"]
            for g in yaml.safe_load(RULE_FILE.read_text())["spec"]["groups"]
            for r in g["rules"]
            if "record" in r
        ]
        exprs = recorded + [e for e in dashboard_exprs(concrete=True) if not any(s in e for s in ONLY_ON_FAILURE)]
        missing: list[str] = []

        def every_query_has_data() -> bool:
            missing[:] = [e for e in exprs if not _query(base, e)]
            return not missing

        try:
            _wait(every_query_has_data, "data for every recording rule and dashboard query", timeout=90)
        except AssertionError:
            raise AssertionError(f"no data for: {missing}") from None
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(15)
        if up is not None:
            os.killpg(up.pid, signal.SIGTERM)  # `up` stops its nodes and router
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(15)
