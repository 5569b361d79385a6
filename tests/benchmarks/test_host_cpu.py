"""benchmarks/host_cpu.py: the machine's CPU split between a server's engines and everything else."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.host_cpu import CpuSampler, CpuWindow, machine_busy_s, proc_stat

pytestmark = pytest.mark.skipif(not CpuSampler.available(), reason="needs Linux /proc")

SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"
# a server root that starts a `router` child and an engine child, each spinning on a core for `spin_s`
SERVER = f"""
import subprocess, sys
spin = {SPIN!r}
kids = [subprocess.Popen([sys.executable, "-c", spin, sys.argv[1], "router"]),
        subprocess.Popen([sys.executable, "-c", spin, sys.argv[1], "decode"])]
for k in kids:
    k.wait()
"""


def test_a_step_window_splits_the_machines_cpu_into_the_engines_and_the_rest() -> None:
    spin_s = 1.5
    root = subprocess.Popen([sys.executable, "-c", SERVER, str(spin_s)])
    try:
        with CpuSampler(root.pid, interval_s=0.05) as cpu:
            time.sleep(0.3)  # both children started and seen
            start = time.time_ns()
            time.sleep(0.8)
            end = time.time_ns()
            root.wait(timeout=30)
    finally:
        root.kill()
    assert len(cpu.front_end) == 2 and len(cpu.engines) == 1  # the root and its router; the decode child
    window = cpu.between(start, end)
    assert window.wall_s == pytest.approx(0.8, abs=0.05)
    # each child spun the whole window, on one core when it has one: the decode child is the engines'
    # CPU, the router child the front end's. How much of a core each got is the scheduler's (under
    # CI beside another suite on 2 cores, 0.28 s of the 0.8), so the floor only says each was seen
    assert 0.05 < window.engine_s <= window.wall_s * 1.1
    assert 0.05 < window.front_s <= window.wall_s * 1.1
    assert window.busy_s >= window.engine_s + window.front_s - 0.1
    summary = window.summary(requests=4)
    assert summary["engine_cores"] == pytest.approx(window.engine_s / window.wall_s, abs=1e-3)
    assert summary["host_cpu_ms_per_request"] == pytest.approx(1000 * (window.busy_s - window.engine_s) / 4, abs=0.1)
    assert summary["front_end_cpu_ms_per_request"] == pytest.approx(1000 * window.front_s / 4, abs=0.1)


def test_the_summary_of_an_empty_window_divides_by_nothing() -> None:
    assert CpuWindow(0.0, 0.0, 0.0, 0.0).summary(0) == {
        "wall_s": 0.0,
        "busy_cores": None,
        "engine_cores": None,
        "host_cpu_ms_per_request": None,
        "front_end_cpu_ms_per_request": None,
    }


def test_proc_readers_parse_the_kernels_formats() -> None:
    assert machine_busy_s("cpu  100 5 50 1000 20 3 2 0 0 0\ncpu0 1 1 1 1 1 1 1 0 0 0\n") > 0
    me = proc_stat(os.getpid())
    assert me is not None and me[0] > 0 and me[1] >= 0
    assert proc_stat(2**22 + 1) is None  # beyond pid_max: no such process
