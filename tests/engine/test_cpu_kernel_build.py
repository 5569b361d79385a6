"""The CPU paged-attention op's build survives a build killed half way (the debris of torch's
builder, including its lock file, must never stall later builds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.attention import cpu_build

BUILD = "from engine.attention.cpu_build import load_paged_attention_op as b; print('op', b() is not None)"


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine")
def test_build_after_a_killed_build_neither_stalls_nor_keeps_debris(tmp_path: Path):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("PDSERVE_NO_CPU_KERNEL", None)
    out = cpu_build.build_dir().relative_to(cpu_build.build_dir().parents[1])  # kernels/<name>
    debris = tmp_path / out
    debris.mkdir(parents=True)
    (debris / "lock").touch()  # what torch's builder leaves when its process is SIGKILLed
    dead = debris.parent / f"{debris.name}.tmp-999999999"  # a private build dir of a dead process
    dead.mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "op True" in done.stdout
    assert (debris / "pdserve_cpu_paged.so").exists() and not dead.exists()
    again = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert "op True" in again.stdout, again.stderr[-2000:]
