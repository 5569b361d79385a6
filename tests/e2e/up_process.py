"""`pdserve up` as a child process for end-to-end tests: started, its output collected, stoppable."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from tests.e2e.cluster import ROOT


@dataclass
class UpProcess:
    """A running `pdserve up`; `lines` fills as it prints, `up` is set once it has said it is up and listed
    its members (or exits)."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    up: threading.Event = field(default_factory=threading.Event)

    def wait_up(self, timeout: float = 180) -> bool:
        return self.up.wait(timeout) and any("pdserve is up" in line for line in self.lines)


def start_up(args: list[str]) -> UpProcess:
    """Start `pdserve up ARGS` in its own session and read its output on a thread."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    up = UpProcess(proc)

    def read() -> None:
        for line in proc.stdout:
            up.lines.append(line.rstrip())
            # the last line of the start-up listing: the member pid lines printed after
            # "pdserve is up" are in `lines` by then, so tests that read them do not race
            if "Ctrl-C stops the cluster" in line:
                up.up.set()
        up.up.set()

    threading.Thread(target=read, daemon=True).start()
    return up
