"""`benchmarks/cachestore_tcp.py --tls` runs end to end on a tiny geometry and reports the TLS
sender beside the plaintext one (its numbers are machine-dependent: only their presence is checked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.cluster import ROOT

pytestmark = pytest.mark.slow  # three sender/receiver pairs in child processes: ~30 s on a busy machine


def test_tls_option_reports_tls_throughput_and_latency():
    args = ["--quick", "--tls", "--layers", "2", "--blocks", "8", "--block-kib", "16", "--layout", "contiguous"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cachestore_tcp", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["contiguous_gbps"] > 0 and result["contiguous_tls_gbps"] > 0
    assert result["contiguous_tls_over_plaintext"] > 0
    assert result["small_transfer_tls_p50_ms"] > 0
