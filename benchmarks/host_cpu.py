"""Where a benchmark's CPU goes while a server is under load: the serving engines' processes, and
everything else on the machine (the router or API front end, the load generator, the kernel's
network work).

`pdserve plan` times each forward alone on its threads; on a machine whose cores also run the
router and the client, the engines get less than the whole budget. `CpuSampler` measures that
share: it samples the machine's busy time (/proc/stat) and each server process's CPU time
(/proc/PID/stat) a few times a second, and `between()` gives the CPU each side took over a window
(a step's first request sent to its last answered), interpolated between samples. The per-request
figure of the non-engine side is what `pdserve plan --host-cpu-ms-per-request` takes.

Linux only (/proc); elsewhere `CpuSampler.available()` is False and the benchmark leaves it out.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
ROUTER_ARG = "\0router\0"
"""A `pdserve up` router child's command line (`python -m pdserve.cli router ...`, NUL-separated)."""


class Sample(NamedTuple):
    """One reading of the counters, at a wall-clock time (time.time_ns)."""

    wall_ns: int
    busy_s: float
    """The machine's busy CPU seconds since boot (user, nice, system, irq, softirq)."""
    engine_s: float
    """The server's engine processes' CPU seconds, each counted from the first sample that saw it."""
    front_s: float
    """The same for its front end (the root, a router child)."""


class CpuWindow(NamedTuple):
    """CPU over one window: seconds of wall time, busy CPU seconds of the machine, of the server's
    engines, of its front end."""

    wall_s: float
    busy_s: float
    engine_s: float
    front_s: float

    def summary(self, requests: int) -> dict:
        """The JSON a step records: cores busy, cores the engines took, the CPU of everything else per
        request, and the front end's part of that."""
        host = max(0.0, self.busy_s - self.engine_s)
        return {
            "wall_s": round(self.wall_s, 2),
            "busy_cores": round(self.busy_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "engine_cores": round(self.engine_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "host_cpu_ms_per_request": round(1000.0 * host / requests, 1) if requests else None,
            # the part of it that is the server's own (pdserve's router, vLLM's API server)
            "front_end_cpu_ms_per_request": round(1000.0 * self.front_s / requests, 1) if requests else None,
        }


def machine_busy_s(stat: str) -> float:
    """Busy seconds from /proc/stat's aggregate `cpu` line (idle, iowait and steal left out)."""
    fields = stat.split("\n", 1)[0].split()
    assert fields[0] == "cpu", f"not /proc/stat: {fields[:1]}"
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    return (user + nice + system + irq + softirq) * TICK_S


def proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(rest[1]), (int(rest[11]) + int(rest[12])) * TICK_S


def is_front_end(pid: int, root: int) -> bool:
    """The server's root (`pdserve up`'s supervisor, `vllm serve`'s API server) and a `pdserve up`
    router child: the processes that parse HTTP and stream tokens, not the engines."""
    if pid == root:
        return True
    try:
        return ROUTER_ARG in "\0" + Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


class CpuSampler:
    """Samples the machine's busy time, and the CPU of the engines and of the front end of the server
    rooted at `root_pid`, every `interval_s` on a daemon thread while the context is open."""

    def __init__(self, root_pid: int, interval_s: float = 0.25) -> None:
        self.root, self.interval_s = root_pid, interval_s
        self.samples: list[Sample] = []
        self._engines: dict[int, float] = {}
        """Engine pids seen, and their CPU seconds since the first sample that saw them, at the last
        sample that did (a process that exits keeps its last reading, so the sum never drops)."""
        self._seen_at: dict[int, float] = {}
        """Every pid seen, and its CPU seconds at the first sample that saw it."""
        self._front: dict[int, float] = {}
        """The same for the front end's pids."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    @property
    def front_end(self) -> set[int]:
        """The pids taken for the front end (the root, a router child)."""
        return set(self._front)

    @property
    def engines(self) -> set[int]:
        """The pids counted as engines (every other process of the server)."""
        return set(self._engines)

    @staticmethod
    def available() -> bool:
        return Path("/proc/stat").exists()

    def __enter__(self) -> "CpuSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _tree(self) -> dict[int, float]:
        """CPU seconds of the root and every live descendant."""
        stats: dict[int, tuple[int, float]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := proc_stat(int(entry.name))) is not None:
                stats[int(entry.name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        found, todo = {}, [self.root]
        while todo:
            pid = todo.pop()
            if pid in stats:
                found[pid] = stats[pid][1]
            todo.extend(children.get(pid, []))
        return found

    def sample(self) -> None:
        """Take one sample now (the thread does this every interval)."""
        for pid, cpu_s in self._tree().items():
            if pid not in self._seen_at:  # counted from now: its CPU before this sample is in no window
                self._seen_at[pid] = cpu_s
                side = self._front if is_front_end(pid, self.root) else self._engines
            else:
                side = self._front if pid in self._front else self._engines
            side[pid] = cpu_s - self._seen_at[pid]
        busy = machine_busy_s(Path("/proc/stat").read_text())
        self.samples.append(Sample(time.time_ns(), busy, sum(self._engines.values()), sum(self._front.values())))

    def _at(self, wall_ns: int) -> tuple[float, float, float]:
        """(busy, engine, front end) seconds at `wall_ns`, linear between the samples around it
        (clamped to the first and last)."""
        times = [s.wall_ns for s in self.samples]
        i = bisect.bisect_left(times, wall_ns)
        if i in (0, len(times)):
            s = self.samples[min(i, len(times) - 1)]
            return s.busy_s, s.engine_s, s.front_s
        a, b = self.samples[i - 1], self.samples[i]
        f = (wall_ns - a.wall_ns) / (b.wall_ns - a.wall_ns)
        return (
            a.busy_s + f * (b.busy_s - a.busy_s),
            a.engine_s + f * (b.engine_s - a.engine_s),
            a.front_s + f * (b.front_s - a.front_s),
        )

    def between(self, start_ns: int, end_ns: int) -> CpuWindow:
        """CPU between two wall-clock times (time.time_ns, as AIPerf's records stamp requests)."""
        assert self.samples, "no sample taken"
        busy0, engine0, front0 = self._at(start_ns)
        busy1, engine1, front1 = self._at(end_ns)
        return CpuWindow((end_ns - start_ns) / 1e9, busy1 - busy0, engine1 - engine0, front1 - front0)
