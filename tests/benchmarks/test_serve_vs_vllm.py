"""`benchmarks/serve_vs_vllm.py` and its AIPerf client: the AIPerf command line, the export it reads,
the ratios and the result line, and the message when AIPerf is missing (a stand-in `aiperf` script
that records its arguments and writes an export in AIPerf's format replaces the real client)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.aiperf_client import Workload, figures, find_aiperf, profile
from benchmarks.common import Rounds
from benchmarks.serve_vs_vllm import compare, compare_alts
from tests.e2e.cluster import ROOT

EXPORT = {
    "output_token_throughput": {"unit": "tokens/sec", "avg": 43.1},
    "time_to_first_token": {"unit": "ms", "avg": 3899.0, "p50": 3181.4, "p99": 7441.9},
    "inter_token_latency": {"unit": "ms", "avg": 117.0, "p50": 106.4, "p99": 150.8},
    "output_sequence_length": {"unit": "tokens", "avg": 64.0},
    "completed_request_count": {"unit": "requests", "avg": 16.0},
    "request_error_rate": {"unit": "%", "avg": 0.0},
}

FAKE = """#!{python}
import json, os, sys
argv = sys.argv[1:]
json.dump(argv, open(os.environ["FAKE_ARGV"], "w"))
if os.environ.get("FAKE_FAIL"):
    print("boom: server unreachable"); sys.exit(3)
out = argv[argv.index("--output-artifact-dir") + 1]
json.dump({export}, open(os.path.join(out, "profile_export_aiperf.json"), "w"))
"""


@pytest.fixture
def fake_aiperf(tmp_path, monkeypatch) -> Path:
    script = tmp_path / "aiperf"
    script.write_text(FAKE.format(python=sys.executable, export=repr(EXPORT)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    return script


def test_profile_sends_the_issue_workload_and_reads_the_export(fake_aiperf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = profile(str(fake_aiperf), "http://127.0.0.1:9", "bench", "/models/bench", Workload(requests=24))
    assert got == {
        "tok_s": 43.1,
        "ttft_p50_ms": 3181.4,
        "ttft_p99_ms": 7441.9,
        "itl_p50_ms": 106.4,
        "itl_p99_ms": 150.8,
        "output_len": 64.0,
        "completed": 16,
        "error_rate_pct": 0.0,
    }
    argv = json.loads((tmp_path / "argv.json").read_text())
    flags = dict(zip(argv, argv[1:]))
    assert argv[0] == "profile" and "--streaming" in argv and "--use-server-token-count" in argv
    assert flags["--endpoint-type"] == "chat" and flags["--concurrency"] == "8" and flags["--request-count"] == "24"
    assert flags["--prompt-input-tokens-mean"] == "128" and flags["--prompt-output-tokens-mean"] == "64"
    assert flags["--tokenizer"] == "/models/bench" and flags["--url"] == "http://127.0.0.1:9"


def test_a_failing_aiperf_is_an_error_with_its_output(fake_aiperf, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(RuntimeError, match="exit 3.*\n.*boom"):
        profile(str(fake_aiperf), "http://127.0.0.1:9", "bench", "/m", Workload())


def test_find_aiperf(fake_aiperf, tmp_path, monkeypatch):
    assert find_aiperf(str(fake_aiperf)) == str(fake_aiperf)
    assert find_aiperf(str(tmp_path / "missing")) is None
    monkeypatch.setenv("PATH", str(fake_aiperf.parent))
    assert find_aiperf(None) == str(fake_aiperf)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_aiperf(None) is None


def test_figures_of_an_export_without_some_metrics_are_nan_not_a_crash():
    got = figures({"output_token_throughput": {"avg": 5.0}})
    assert got["tok_s"] == 5.0 and got["ttft_p99_ms"] != got["ttft_p99_ms"] and got["completed"] == 0


def test_the_result_line_carries_the_medians_and_every_round() -> None:
    ours = figures(EXPORT)
    peer = {**ours, "tok_s": 86.2, "ttft_p99_ms": 3720.95, "itl_p99_ms": 301.6}
    # three rounds: pdserve's TTFT p99 moves, vLLM's is steady; the ratio is the median of the rounds'
    slow, fast = {**ours, "ttft_p99_ms": 9000.0}, {**ours, "ttft_p99_ms": 3720.95}
    runs = Rounds(
        [{"pdserve": ours, "vllm": peer}, {"vllm": peer, "pdserve": slow}, {"pdserve": fast, "vllm": peer}], {}
    )
    line = compare(runs, "")
    assert line["metric"] == "ttft_p99_ratio" and line["target"] == 1.0
    assert line["value"] == 7441.9 and abs(line["baseline"] - 3720.95) <= 0.05
    assert line["ratio"] == line["ttft_p99_ms_ratio"] == 2.0 and line["round_ratios"] == [2.0, 2.419, 1.0]
    assert line["tok_s_ratio"] == 0.5 and line["itl_p99_ms_ratio"] == 0.5 and line["itl_p50_ms_ratio"] == 1.0
    assert len(line["rounds"]) == 3 and line["rounds"][1]["pdserve"]["ttft_p99_ms"] == 9000.0
    assert line["vllm_mode"].startswith("default") and "vllm_error" not in line
    alone = compare(Rounds([{"pdserve": ours}] * 3, {}), "not run: no --vllm-python given (pdserve alone)")
    assert alone["ratio"] is None and alone["baseline"] is None and "pdserve alone" in alone["vllm"]
    assert alone["value"] == 7441.9


def test_an_extra_pdserve_arm_is_reported_against_the_default_arm_round_by_round() -> None:
    ours = figures(EXPORT)
    alt = [{**ours, "ttft_p99_ms": ours["ttft_p99_ms"] * f, "tok_s": ours["tok_s"] * 2} for f in (0.5, 3.0, 1.5)]
    runs = Rounds([{"pdserve": ours, "pdserve-alt0": a} for a in alt], {})
    got = compare_alts(runs, {"pdserve-alt0": "--prefill-saturated-tokens 0"})["pdserve-alt0"]
    assert got["up_args"] == "--prefill-saturated-tokens 0"
    assert got["ttft_p99_vs_default_per_round"] == [0.5, 3.0, 1.5] and got["ttft_p99_ms_vs_default"] == 1.5
    assert got["tok_s_vs_default"] == 2.0 and got["figures"]["ttft_p99_ms"] == ours["ttft_p99_ms"] * 1.5


def test_the_benchmark_says_when_aiperf_is_missing(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_vs_vllm", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 2 and "AIPerf not found" in run.stderr and "pip install aiperf" in run.stderr
