"""Start pdserve node processes for benchmarks (127.0.0.1 only) and stop them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pdserve.node_runtime.supervisor import Child

ROOT = Path(__file__).resolve().parent.parent


class NodeProc(Child):
    """`pdserve ROLE ARGS`, started and READY (its address known); always stop() it."""

    def __init__(self, role: str, args: list[str], timeout: float = 180.0, cpus: frozenset[int] | None = None) -> None:
        super().__init__(
            role,
            [sys.executable, "-m", "pdserve.cli", role, *args],
            {**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
            ready_prefix=f"READY {role} ",
            echo_errors=False,
            cpus=cpus,
        )
        try:
            self.wait_ready(time.monotonic() + timeout)
        except RuntimeError:
            self.stop()
            raise
