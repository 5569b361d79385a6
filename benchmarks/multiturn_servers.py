"""Server processes of benchmarks/multiturn.py: a `pdserve up` cluster or a `vllm serve`, each in its
own process group, started until its ready line and stopped with everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

from benchmarks.cluster_procs import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_up(model: str, port: int, metrics_base: int, extra: list[str]) -> subprocess.Popen:
    return start_pdserve(
        model, port, ["--num-prefill", "2", "--num-decode", "2", "--metrics-base-port", str(metrics_base), *extra]
    )


def start_pdserve(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    """`pdserve up --model MODEL --port PORT EXTRA...` (its defaults otherwise), once it is up."""
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--port", str(port), *extra]
    # The nodes build the CPU attention op on first use and serve on the slower torch path meanwhile
    # (a compiler on one core for about a minute): a once-per-machine cost, not part of a measurement.
    from pdserve.engine.kernels import cpu_build

    cpu_build.load_paged_attention_op()
    # the defaults a user gets: no liveness limit is raised (a busy node is not taken for a hung one)
    return start_server(cmd, lambda line: "pdserve is up" in line, dict(os.environ))


VLLM_MODE = "default: compiled path (torch.compile, inductor), default multiprocess executor"
"""How `start_vllm` runs vLLM, as the result lines state it: nothing that turns its compiled path
off. Eager mode and the single-process executor were forced on 2026-11-25 after a start-up
"hung" and are gone; vLLM CPU 0.32.0's default start (2026-11-29, 2-core Xeon VM, shared) compiles for ~63 s,
during which its engine logs "No available shared memory broadcast block found in 60 seconds ...
hanging", then is ready (about 110 s from launch); later starts reuse its compile cache."""

VLLM_READY_TIMEOUT_S = 1800.0
"""How long `vllm serve` may take to be ready: compiling on two loaded cores takes minutes, and
that is start-up, not a handicap; a start that is still not ready then is a real hang."""


def start_vllm(python: str, model: str, port: int, extra: list[str]) -> subprocess.Popen:
    """`vllm serve` of a vLLM CPU install (../shared/MACHINE.md) in its default mode (VLLM_MODE),
    fp32 like the nodes, once it is up."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    cmd += ["--dtype", "float32", *extra]  # its own block size: vLLM's CPU attention takes only multiples of 32
    # every usable core for its OpenMP threads (its default computes on one of them)
    cpus = sorted(os.sched_getaffinity(0))
    contiguous = cpus[-1] - cpus[0] + 1 == len(cpus)
    cores = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}
    env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    return start_server(cmd, lambda line: "Application startup complete" in line, env, VLLM_READY_TIMEOUT_S)


def start_server(
    cmd: list[str], ready, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.Popen:
    """Start `cmd` in its own process group and wait for a `ready` line (at most `timeout` seconds:
    then its group is killed and this raises); its output keeps being read afterwards, so that it
    never blocks on a full pipe."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    # the read below blocks on the pipe: a timer ends a start that never gets ready
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer:
        timer.daemon = True
        timer.start()
    tail: list[str] = []
    keep = open(os.environ["BENCH_SERVER_LOG"], "a", buffering=1) if os.environ.get("BENCH_SERVER_LOG") else None
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-200:]  # enough for a worker's traceback and its root cause
        if keep:
            keep.write(line)
        if ready(line):
            if timer:
                timer.cancel()
            # $BENCH_SERVER_LOG: a file that keeps the servers' output (else it is read and dropped)
            threading.Thread(target=lambda: [keep.write(x) if keep else None for x in proc.stdout], daemon=True).start()
            return proc
    if timer:
        timer.cancel()
    stop(proc)
    late = f" (not ready after {timeout:.0f} s: killed)" if expired.is_set() else ""
    raise RuntimeError(f"{' '.join(cmd)} exited before it was ready{late}:\n{''.join(tail)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
