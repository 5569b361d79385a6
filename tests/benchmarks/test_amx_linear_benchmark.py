"""benchmarks/amx_linear.py: one JSON line whose rows time both kernels on the same packed weights
and agree on their output; exit 2 (no comparison) where the CPU has no AMX."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from engine.attention import cpu_build

ROOT = Path(__file__).resolve().parents[2]


def test_amx_linear_benchmark_quick() -> None:
    assert cpu_build.load_paged_attention_op() is not None, "this machine has a C++ compiler: the op must build"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.amx_linear", "--quick", "--rows", "16", "40", "--rounds", "1"]
        + ["--copies", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not torch.ops.pdserve_cpu.amx_available():
        assert proc.returncode == 2 and "no AMX" in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"metric", "value", "baseline", "ratio", "target"} <= result.keys()
    assert [r["rows"] for r in result["rows"]] == [16, 40]
    for row in result["rows"]:
        assert row["onednn_ms"] > 0 and row["amx_ms"] > 0
        assert row["max_diff_rel"] < 0.02, row  # summation order: about a bf16 step of the largest output
