"""schemathesis (positive mode, as vLLM runs it) against the router's /openapi.json: no 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import stop
from tests.e2e.router_cluster import API_KEY, start_full

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_schemathesis_finds_no_server_errors(tiny_model_dir, tmp_path):
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    cluster, router, base = start_full(str(tiny_model_dir), extra=["--max-model-len", "256"])
    try:
        result = subprocess.run(
            [
                exe,
                "run",
                f"{base}/openapi.json",
                "--mode",
                "positive",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "1",
                "--request-timeout",
                "120",
                "--generation-deterministic",
                "-H",
                f"Authorization: Bearer {API_KEY}",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    finally:
        stop(router)
        cluster.stop()
