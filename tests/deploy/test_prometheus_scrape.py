"""A real Prometheus scrapes a running cluster on loopback (slow; needs the apt `prometheus` package).

It checks what an SRE relies on: every process's /metrics passes `promtool check metrics`,
every target is up, and after a few requests every recording rule of the monitoring
component and every dashboard query returns data.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request

import httpx
import pytest
import yaml

from tests.deploy.test_monitoring import RULE_FILE, dashboard_exprs
from tests.e2e.cluster import start, stop
from tests.e2e.router_cluster import API_KEY, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SECRET = "prom-secret"
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


def test_prometheus_scrapes_every_process_and_every_query_has_data(tmp_path, tiny_model_dir):
    if subprocess.run(["which", "prometheus", "promtool"], capture_output=True).returncode != 0:
        pytest.skip("prometheus/promtool not installed (scripts/install_ops_tools.sh installs them)")
    procs = []
    prom = None
    try:
        node_ports = {"prefill": free_port(), "decode": free_port()}
        common = ["--port", "0", "--cluster-secret", SECRET, "--num-threads", "1", "--model", str(tiny_model_dir)]
        nodes = {role: start(role, common + ["--metrics-port", str(port)]) for role, port in node_ports.items()}
        procs += nodes.values()
        http_port = free_port()
        procs.append(start("router", ["--port", str(http_port), "--model", str(tiny_model_dir), "--cluster-secret",
                                      SECRET, "--api-key", API_KEY, "--prefill", nodes["prefill"].address,
                                      "--decode", nodes["decode"].address], ready_prefix="READY router "))
        targets = [f"127.0.0.1:{p}" for p in (*node_ports.values(), http_port)]

        for target in targets:  # the exposition itself passes promtool's linter
            body = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read()
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
            assert lint.returncode == 0, (target, lint.stdout.decode() + lint.stderr.decode())

        rules = tmp_path / "rules.yaml"
        rules.write_text(yaml.safe_dump(yaml.safe_load(RULE_FILE.read_text())["spec"]))
        config = tmp_path / "prometheus.yml"
        # namespace/pod labels as the Prometheus Operator would attach them, so the rules and dashboard match.
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "pdserve", "static_configs": [
                {"targets": [t], "labels": {"namespace": "pd", "pod": name}}
                for t, name in zip(targets, ("prefill-0", "decode-0", "router-0"))]}]}))
        prom_port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/data",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        base = f"http://127.0.0.1:{prom_port}"

        def all_up() -> bool:
            try:
                return sum(float(r["value"][1]) for r in _query(base, "up")) == len(targets)
            except (httpx.HTTPError, AssertionError):
                return False
        _wait(all_up, "every target up")

        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            for i in range(4):
                r = client.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": f"hello {i}",
                                                         "max_tokens": 6, "stream": i % 2 == 0})
                assert r.status_code == 200, r.text
        time.sleep(1)

        recorded = [r["record"] for g in yaml.safe_load(RULE_FILE.read_text())["spec"]["groups"] for r in g["rules"]
                    if "record" in r]
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
        for p in reversed(procs):
            stop(p)
