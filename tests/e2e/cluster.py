"""Start real pdserve processes on 127.0.0.1 for end-to-end tests, and always stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 90.0


@dataclass
class Proc:
    """One child process and what it printed."""

    role: str
    popen: subprocess.Popen
    address: str = ""
    lines: list[str] = field(default_factory=list)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


def start(role: str, args: list[str], env: dict[str, str] | None = None, ready_prefix: str | None = None) -> Proc:
    """Run `pdserve ROLE ARGS`, wait for its READY line (or fail with its output)."""
    cmd = [sys.executable, "-m", "pdserve.cli", role, *args]
    popen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    proc = Proc(role, popen)
    ready = threading.Event()
    prefix = ready_prefix or f"READY {role} "

    def reader() -> None:
        for line in popen.stdout:
            proc.lines.append(line.rstrip())
            if line.startswith(prefix):
                proc.address = line[len(prefix):].strip()
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    if not ready.wait(READY_TIMEOUT) or not proc.address:
        stop(proc)
        raise RuntimeError(f"{role} did not become ready:\n{proc.tail()}")
    return proc


def stop(proc: Proc, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
    """Signal the process group, then kill it if it lingers."""
    if proc.popen.poll() is None:
        try:
            os.killpg(proc.popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(5)
    return proc.popen.returncode


@dataclass
class Cluster:
    """N prefill + M decode node processes sharing a model, transport and secret."""

    prefills: list[Proc]
    decodes: list[Proc]
    secret: str

    def all(self) -> list[Proc]:
        return self.prefills + self.decodes

    def stop(self) -> None:
        for p in self.all():
            stop(p)


def start_cluster(num_prefill: int = 1, num_decode: int = 2, *, transport: str = "tcp", model: str | None = None,
                  secret: str = "e2e-secret", extra: list[str] | None = None,
                  decode_extra: list[str] | None = None, env: dict[str, str] | None = None) -> Cluster:
    common = ["--port", "0", "--transport", transport, "--cluster-secret", secret, "--num-threads", "1",
              *(["--model", model] if model else []), *(extra or [])]
    started: list[Proc] = []
    try:
        prefills = []
        for _ in range(num_prefill):
            prefills.append(start("prefill", common, env))
            started.append(prefills[-1])
        decodes = []
        for _ in range(num_decode):
            decodes.append(start("decode", common + (decode_extra or []), env))
            started.append(decodes[-1])
    except Exception:
        for p in started:
            stop(p)
        raise
    return Cluster(prefills, decodes, secret)
