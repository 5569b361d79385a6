"""Start real pdserve processes on 127.0.0.1 for end-to-end tests, and always stop them."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.node_runtime.supervisor import Child

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 90.0
REMOTE_ONLY = ["--local-prefill-max-tokens", "0"]
"""Decode nodes of these clusters prefill locally only when a request names no prefill node: the
tests that start them exercise the split (transfers, fencing, a failed prefill that must fail).
Local prefill has its own tests (test_kv_reuse.py, test_decode_only.py); decode_extra overrides it."""


class Proc(Child):
    """One `pdserve ROLE` child process; every line it printed is kept (tests count log lines)."""

    @property
    def role(self) -> str:
        return self.name


def start(role: str, args: list[str], env: dict[str, str] | None = None, ready_prefix: str | None = None) -> Proc:
    """Run `pdserve ROLE ARGS`, wait for its READY line (or fail with its output)."""
    proc = Proc(
        role,
        [sys.executable, "-m", "pdserve.cli", role, *args],
        {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=ROOT,
        ready_prefix=ready_prefix or f"READY {role} ",
        max_lines=None,
        echo_errors=False,
    )
    try:
        proc.wait_ready(time.monotonic() + READY_TIMEOUT)
    except RuntimeError:
        proc.stop()
        raise
    return proc


def stop(proc: Proc, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
    """Signal the process group, then kill it if it lingers."""
    return proc.stop(sig, timeout)


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


def start_cluster(
    num_prefill: int = 1,
    num_decode: int = 2,
    *,
    transport: str = "tcp",
    model: str | None = None,
    secret: str = "e2e-secret",
    extra: list[str] | None = None,
    decode_extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Cluster:
    common = [
        "--port",
        "0",
        "--transport",
        transport,
        "--cluster-secret",
        secret,
        "--num-threads",
        "1",
        *(["--model", model] if model else []),
        *(extra or []),
    ]
    started: list[Proc] = []
    try:
        prefills = []
        for _ in range(num_prefill):
            prefills.append(start("prefill", common, env))
            started.append(prefills[-1])
        decodes = []
        for _ in range(num_decode):
            decodes.append(start("decode", common + REMOTE_ONLY + (decode_extra or []), env))
            started.append(decodes[-1])
    except Exception:
        for p in started:
            stop(p)
        raise
    return Cluster(prefills, decodes, secret)
