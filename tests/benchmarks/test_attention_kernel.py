"""benchmarks/attention_kernel.py --against sdpa: one JSON line whose rows time both paths on the same
prompts and agree on their output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels.cpu_build import load_paged_attention_op

ROOT = Path(__file__).resolve().parents[2]


def test_prompt_kernel_against_sdpa_quick() -> None:
    assert load_paged_attention_op() is not None, "this machine has a C++ compiler: the op must build"
    if not torch.ops.pdserve_cpu.prefill_supported(64):
        pytest.skip("the prompt kernel needs AVX-512")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.attention_kernel", "--against", "sdpa", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"metric", "value", "baseline", "ratio", "target"} <= result.keys()
    assert {(r["dtype"], r["tokens"]) for r in result["rows"]} == {
        (dt, n) for dt in ("float32", "bfloat16") for n in (64, 256)
    }
    amx = bool(torch.ops.pdserve_cpu.prefill_amx_supported(64))
    assert result["bf16_kernel"] == ("amx" if amx else "avx512") and result["bf16_ratio"] > 0
    for row in result["rows"]:
        assert row["kernel_us"] > 0 and row["sdpa_us"] > 0
        assert row["max_abs_diff"] < (1e-5 if row["dtype"] == "float32" else 5e-2), row
