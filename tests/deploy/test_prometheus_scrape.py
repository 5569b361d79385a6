"""A real Prometheus scrapes a running `pdserve up` on loopback (slow; needs the apt `prometheus` package).

It checks what an SRE relies on: every process's /metrics passes `promtool check metrics`,
every target is up, and after a few requests every dashboard query returns data and every
alert expression evaluates.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest
import yaml

from tests.deploy.prom_cluster import scraped_cluster, wait_for
from tests.deploy.test_monitoring import RULE_FILE, dashboard_exprs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
# Series that exist only after something went wrong (no rejected frame in a healthy run).
ONLY_ON_FAILURE = ("pdserve_cachestore_rejected_frames",)


def test_prometheus_scrapes_every_process_and_every_query_has_data(tmp_path, tiny_model_dir):
    with scraped_cluster(tmp_path, tiny_model_dir) as cluster:
        for target in cluster.targets.values():  # the exposition itself passes promtool's linter
            body = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read()
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
            # vLLM's names use the colon promtool reserves for recording rules: matching them is the point
            problems = [
                line
                for line in (lint.stdout.decode() + lint.stderr.decode()).splitlines()
                if line and not (line.startswith("vllm:") and line.endswith("metric names should not contain ':'"))
            ]
            assert not problems, (target, problems)

        with cluster.client() as client:
            for i in range(4):
                r = client.post(
                    "/v1/completions",
                    json={"model": "pdserve-tiny", "prompt": f"hello {i}", "max_tokens": 6, "stream": i % 2 == 0},
                )
                assert r.status_code == 200, r.text
        time.sleep(1)

        exprs = [e for e in dashboard_exprs(concrete=True) if not any(s in e for s in ONLY_ON_FAILURE)]
        missing: list[str] = []

        def every_query_has_data() -> bool:
            missing[:] = [e for e in exprs if not cluster.query(e)]
            return not missing

        try:
            wait_for(every_query_has_data, "data for every dashboard query", timeout=90)
        except AssertionError:
            raise AssertionError(f"no data for: {missing}") from None
        groups = yaml.safe_load(RULE_FILE.read_text())["spec"]["groups"]
        for rule in (r for g in groups for r in g["rules"]):  # each alert's expression is valid on live data
            cluster.query(rule["expr"])
