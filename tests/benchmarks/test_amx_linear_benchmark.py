"""benchmarks/amx_linear.py: one JSON line whose rows time both kernels on the same packed weights
and agree on their output, in bf16 (AMX) and float32 (AVX-512); exit 2 (no comparison) where the CPU
lacks the kernel's instructions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_linear_kernel_benchmark_quick(dtype: str) -> None:
    assert cpu_build.load_paged_attention_op() is not None, "this machine has a C++ compiler: the op must build"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.amx_linear", "--quick", "--rows", "16", "40", "--rounds", "1"]
        + ["--copies", "2", "--dtype", dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    bf16 = dtype == "bfloat16"
    available = torch.ops.pdserve_cpu.amx_available() if bf16 else torch.ops.pdserve_cpu.f32_linear_available()
    if not available:
        assert proc.returncode == 2 and ("no AMX" if bf16 else "no AVX-512") in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"metric", "value", "baseline", "ratio", "target"} <= result.keys()
    assert result["dtype"] == dtype
    assert [r["rows"] for r in result["rows"]] == [16, 40]
    for row in result["rows"]:
        assert row["onednn_ms"] > 0 and row["kernel_ms"] > 0
        # summation order: about a bf16 step of the largest output in bf16, float32 ulps in float32
        assert row["max_diff_rel"] < (0.02 if bf16 else 1e-5), row
