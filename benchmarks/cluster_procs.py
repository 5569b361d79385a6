"""Start pdserve node processes for benchmarks (127.0.0.1 only) and stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class NodeProc:
    """`pdserve ROLE ARGS` with its READY address; always stop() it."""

    def __init__(self, role: str, args: list[str], timeout: float = 180.0) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "pdserve.cli", role, *args], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.address = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.popen.stdout:
                self.lines.append(line.rstrip())
                if line.startswith(f"READY {role} "):
                    self.address = line.split()[-1]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not self.address:
            self.stop()
            raise RuntimeError(f"{role} failed to start:\n" + "\n".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
