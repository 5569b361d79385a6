"""Stage heartbeats: a hung (SIGSTOPped, deadlocked) or cut-off stage is named within a bound.

gloo cannot poll or cancel a receive, so a stage that stops answering without dying leaves the
controller blocked forever. Every stage therefore bumps a counter on the rendezvous store (which
rank 0 hosts) every `HEARTBEAT_INTERVAL_S` from a thread of its own; the controller's monitor
thread reads the counters, and a stage whose counter has not moved for `timeout_s` is reported to
`on_stall(rank, silent_s)` once.

Bound: a stage that stops at time t is reported by t + timeout_s + 2 * HEARTBEAT_INTERVAL_S (its
last beat came at most one interval before t; the monitor looks once per interval). A stopped
process runs no thread at all and a partitioned one cannot reach the store, so both go silent;
a busy one keeps beating (its forward releases the GIL), so a long batch is never taken for a hang.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
"""Generous for a loaded 2-core machine, where a runnable process can wait seconds for a core."""


def _key(rank: int) -> str:
    return f"tdpipe/heartbeat/{rank}"


def start_heartbeat(store: dist.Store, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S) -> threading.Event:
    """Beat for `rank` until the returned event is set or the store is gone (the controller ended)."""
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            try:
                store.add(_key(rank), 1)
            except Exception:  # the store (rank 0) is gone: the job is over, nothing to report to
                return
            done.wait(interval_s)

    threading.Thread(target=beat, name=f"heartbeat-{rank}", daemon=True).start()
    return done


class HeartbeatMonitor:
    """Rank 0's watch over stage ranks 1..num_stages (see the module docstring for the bound).

    `last_beat_age()` gives each stage's seconds since its counter last moved, for a progress line
    or metrics; `close()` stops the thread (always, when the pipeline ends)."""

    def __init__(
        self,
        store: dist.Store,
        num_stages: int,
        timeout_s: float,
        on_stall: Callable[[int, float], None],
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        if timeout_s <= interval_s:
            raise ValueError(f"--heartbeat-timeout must be more than the {interval_s:g} s beat interval")
        self.store, self.timeout_s, self.on_stall, self.interval_s = store, timeout_s, on_stall, interval_s
        now = time.monotonic()
        self._seen = {rank: (-1, now) for rank in range(1, num_stages + 1)}
        """rank -> (last counter value, when it last changed)."""
        self.stalled: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat-monitor", daemon=True)
        self._thread.start()

    def last_beat_age(self) -> dict[int, float]:
        now = time.monotonic()
        return {rank: now - changed for rank, (_, changed) in self._seen.items()}

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            now = time.monotonic()
            for rank, (count, changed) in self._seen.items():
                try:
                    value = self.store.add(_key(rank), 0)  # reads without blocking on a missing key
                except Exception:  # the store is shutting down with the job
                    return
                if value != count:
                    self._seen[rank] = (value, now)
                elif now - changed > self.timeout_s and not self._done.is_set():
                    self.stalled = rank
                    self.on_stall(rank, now - changed)
                    return

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
