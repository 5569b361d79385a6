"""Supervising the processes of `pdserve up`: start, watch, restart with backoff, detect crash loops.

A node that dies is restarted on the port it had, so static discovery (the router's
`--prefill/--decode` lists) finds it again without any re-registration. A node that
keeps dying (`max_restarts` within `window` seconds) is a crash loop: restarting it
again would only hide the failure, so the supervisor reports it and `up` stops.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import threading
import time
from typing import Callable

LOG_TAIL_LINES = 200
"""Lines of each child's output kept in memory (for error reports); older lines are dropped."""


class Child:
    """One process in its own process group whose output is scanned for its READY line.

    The one way pdserve starts and stops its processes: `pdserve up`, the end-to-end tests
    (`tests/e2e/cluster.py`) and the benchmarks (`benchmarks/cluster_procs.py`) all use it.
    The READY line's last word is the address; `stop()` signals the whole group (a node's own
    children too), then kills it if it lingers. The child also gets SIGTERM if we die."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        *,
        cwd: str | os.PathLike | None = None,
        ready_prefix: str = "READY ",
        max_lines: int | None = LOG_TAIL_LINES,
        echo_errors: bool = True,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """`max_lines`: how much output to keep (None: all of it, for tests that count log lines);
        `echo_errors`: print the child's ERROR and Traceback lines as they come (for `up`);
        `cpus`: pin the child (and what it starts) to these CPUs (None: wherever we may run)."""
        self.name = name
        self.popen = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=functools.partial(_in_child, cpus),
        )
        self.address = ""
        self.ready = threading.Event()
        self.ready_prefix = ready_prefix
        self.echo_errors = echo_errors
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        threading.Thread(target=self._read, name=f"log-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None  # stdout=PIPE
        for line in self.popen.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if line.startswith(self.ready_prefix):
                self.address = line.split()[-1]
                self.ready.set()
            elif self.echo_errors and ("ERROR" in line or "Traceback" in line):
                print(f"[{self.name}] {line}", flush=True)
        self.ready.set()

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.lines)[-n:])

    def wait_ready(self, deadline: float) -> str:
        self.ready.wait(max(0.0, deadline - time.monotonic()))
        if not self.address:
            try:  # output ended (the child is exiting): give the kernel a moment to report its status
                rc = self.popen.wait(timeout=2.0) if self.ready.is_set() else self.popen.poll()
            except subprocess.TimeoutExpired:
                rc = None
            # a child killed by a signal (the OOM killer's SIGKILL) prints nothing: say so
            how = "still not ready at the deadline" if rc is None else f"exited with {_exit_status(rc)}"
            raise RuntimeError(f"{self.name} failed to start ({how}):\n{self.tail()}")
        return self.address

    @property
    def exited(self) -> bool:
        return self.popen.poll() is not None

    def send(self, sig: int) -> None:
        """Send `sig` to the process group and return at once (a node given SIGTERM drains first)."""
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> int | None:
        """Send `sig` to the process group, wait up to `grace` s, then SIGKILL it; the exit code."""
        if not self.exited:
            self.send(sig)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode


def _exit_status(rc: int) -> str:
    """`rc` as Popen reports it, with a signal named (-9 -> "signal SIGKILL")."""
    if rc >= 0:
        return f"code {rc}"
    try:
        return f"signal {signal.Signals(-rc).name}"
    except ValueError:
        return f"signal {-rc}"


_prctl: Callable[..., int] | None
try:  # looked up once here: between fork and exec (other threads running) only the call itself runs
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux: Ctrl-C / SIGTERM on `up` still stop every child
    _prctl = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the supervisor dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG = 1), so a killed `pdserve up` leaves no orphaned nodes holding ports."""
    if _prctl is not None:
        _prctl(1, int(signal.SIGTERM))


def _in_child(cpus: frozenset[int] | None) -> None:
    """Before exec: die with the parent, and take the CPU set (inherited across exec and by the
    node's own children, e.g. its tensor-parallel ranks)."""
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


class RestartPolicy:
    """Exponential backoff between restarts; a crash loop is `max_restarts` restarts within `window` s."""

    def __init__(
        self,
        max_restarts: int = 5,
        window: float = 60.0,
        base_delay: float = 0.5,
        max_delay: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.clock = clock
        self.restart_times: collections.deque[float] = collections.deque()

    def _recent(self) -> int:
        now = self.clock()
        while self.restart_times and now - self.restart_times[0] > self.window:
            self.restart_times.popleft()
        return len(self.restart_times)

    def crash_looping(self) -> bool:
        return self._recent() >= self.max_restarts

    def next_delay(self) -> float:
        return min(self.max_delay, self.base_delay * 2 ** self._recent())

    def record(self) -> None:
        self.restart_times.append(self.clock())


class Supervised:
    """A named process that `Supervisor` keeps alive; `command(port)` builds its command line."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        port: int,
        env: dict[str, str],
        policy: RestartPolicy | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.cpus = cpus  # kept across restarts: a restarted node gets its own cores back
        self.command = command
        self.port = port
        self.env = env
        self.policy = policy or RestartPolicy()
        self.child: Child | None = None
        self.restart_at: float | None = None
        self.num_restarts = 0

    def start(self) -> Child:
        self.child = Child(self.name, self.command(self.port), self.env, cpus=self.cpus)
        return self.child

    def wait_ready(self, deadline: float) -> str:
        assert self.child is not None, "start() first"
        address = self.child.wait_ready(deadline)
        self.port = int(address.rsplit(":", 1)[1])  # a node started on port 0 keeps the port it found
        return address


class Supervisor:
    """Watches supervised processes; restarts a dead one on the same port after a backoff delay."""

    def __init__(self, members: list[Supervised], log: Callable[[str], None] = print) -> None:
        self.members = members
        self.log = log
        self.num_restarts = 0

    def poll(self) -> str | None:
        """One supervision step. Returns a reason to stop the cluster (a crash loop), else None."""
        now = time.monotonic()
        for m in self.members:
            child = m.child
            if m.restart_at is None and child is not None and child.exited:
                if m.policy.crash_looping():
                    return (
                        f"{m.name} exited with {child.popen.returncode} after {m.policy.max_restarts} restarts "
                        f"in {m.policy.window:.0f} s (crash loop); last output:\n{child.tail()}"
                    )
                delay = m.policy.next_delay()
                m.restart_at = now + delay
                self.log(
                    f"{m.name} exited with {child.popen.returncode}; restarting it on port {m.port} in {delay:.1f} s"
                )
            elif m.restart_at is not None and now >= m.restart_at:
                m.restart_at = None
                m.policy.record()
                m.num_restarts += 1
                self.num_restarts += 1
                m.start()
                threading.Thread(target=self._announce, args=(m, m.child), daemon=True).start()
        return None

    def _announce(self, m: Supervised, child: Child) -> None:
        child.ready.wait(180.0)
        if child.address:
            self.log(f"{m.name} is back at {child.address} (restart {m.num_restarts})")

    def stop(self) -> None:
        for m in reversed(self.members):
            if m.child is not None:
                m.child.stop()
