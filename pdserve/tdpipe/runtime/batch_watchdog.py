"""The batch job's watchdog: gloo cannot poll or cancel a receive, so the main thread can sit in a
blocking wait when a stage dies or a signal arrives. A second thread watches the stage processes
and the signals (through `signal.set_wakeup_fd`, written by the C-level handler even while the
main thread is blocked), stops the stages so that the blocked receive fails, and as a last resort
ends the process itself: every finished result is already flushed, so `--resume` loses nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time

from pdserve.tdpipe.runtime.controller import StageExecutor
from pdserve.tdpipe.runtime.local import stop_on_purpose, stopped_on_purpose

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STAGE_TERM_GRACE_S = 5.0
"""A stage that ignores SIGTERM this long is SIGKILLed."""
HARD_EXIT_GRACE_S = 20.0
"""After a stage died or a signal came, how long the main thread may stay blocked before the
watchdog ends the process (results are flushed line by line, so nothing is lost)."""


def describe_exit(rank: int, pid: int, code: int | None) -> str:
    """`stage rank 2 (pid 123) was killed by SIGKILL` / `... exited with code 1` (code as Popen's)."""
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"stage rank {rank} (pid {pid}) {how}"


def _wait_exit(proc: subprocess.Popen) -> int | None:
    """Block until `proc` exits, without reaping it (Popen still owns that); its Popen-style code."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped by Popen (in another thread): wait() returns its code
        return proc.wait()
    if info is None:
        return proc.poll()
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class StageWatchdog:
    """Watches the local stage processes and SIGINT/SIGTERM on behalf of a blocked main thread.

    Use from the main thread: `install()` before the pipeline starts, `watch(procs)` once the
    stages exist, `close()` when the job returns (always, in a finally).
    """

    def __init__(self, progress=None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.dead: list[str] = []
        """Stages seen exited before the job ended, in the order they were noticed, not counting those
        the launcher or this watchdog stopped (`stopped`): a waiter thread can notice a stage killed
        during the stop before the one whose death caused it."""
        self.stopped: list[str] = []
        self.stalled: list[str] = []
        """Stages whose heartbeat went silent (SIGSTOPped, hung, cut off): `stage_stalled`."""
        self.signum: int | None = None
        self.executor: StageExecutor | None = None
        self.progress = progress
        self._done = threading.Event()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}
        self._trouble_since: float | None = None
        self._lock = threading.Lock()
        self._last_refresh = 0.0
        self._thread = threading.Thread(target=self._loop, name="batch-watchdog", daemon=True)

    def install(self) -> None:
        self._old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()

    def watch(self, procs: list[subprocess.Popen]) -> None:
        """Record each stage's exit the moment it happens (one waiter thread per stage): the launcher
        kills the survivors right after a failure, and only the order of exits names the culprit."""
        self.procs = list(procs)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._waiter, args=(rank, proc), name=f"stage-{rank}-exit", daemon=True).start()

    def _waiter(self, rank: int, proc: subprocess.Popen) -> None:
        code = _wait_exit(proc)
        if code != 0:  # 0 comes only after the controller's shutdown message: not a failure
            with self._lock:
                (self.stopped if stopped_on_purpose(proc) else self.dead).append(describe_exit(rank, proc.pid, code))

    def stage_stalled(self, rank: int, silent_s: float) -> None:
        """The heartbeat monitor's `on_stall`: name the stage and stop the pipeline. A local stage is
        SIGKILLed (a stopped process ignores SIGTERM until continued), which fails the receive the
        main thread is blocked in; the loop then stops the other stages as for a death. A stage
        elsewhere cannot be stopped from here, so the job ends at once (every result is flushed)."""
        proc = self.procs[rank - 1] if rank <= len(self.procs) else None
        who = f"stage rank {rank}" + (f" (pid {proc.pid})" if proc is not None else "")
        why = f"{who} stopped answering: no heartbeat for {silent_s:.0f} s (stopped, hung or cut off)"
        with self._lock:
            self.stalled.append(why)
        if proc is None:
            os.write(2, f"\nerror: pipeline stage stalled: {why}; rerun with --resume to finish\n".encode())
            os._exit(1)
        stop_on_purpose(proc)
        with self._lock:
            self.dead.append(why)  # wakes the loop, which stops the others and bounds the unwinding

    def _on_signal(self, signum: int, frame) -> None:
        # Runs in the main thread whenever it gets back to Python: unwinds the job from there.
        self.signum = self.signum or signum
        raise KeyboardInterrupt

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._refresh_progress(force=True)  # the bar's last line shows the final rate
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        os.close(self._rfd)
        os.close(self._wfd)

    def wait_for_dead(self, timeout: float) -> list[str]:
        """The dead stages, the ones that died on their own first, waiting up to `timeout` s for one
        to show: a stage's connection can close a moment before its process is reaped, so the first
        error may come before its exit."""
        deadline = time.monotonic() + timeout
        while not self.dead and self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            return self.dead + self.stopped

    def _terminate_stages(self) -> None:
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            stop_on_purpose(p, signal.SIGTERM)
        deadline = time.monotonic() + STAGE_TERM_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_on_purpose(p)

    def _loop(self) -> None:
        while not self._done.is_set():
            ready, _, _ = select.select([self._rfd], [], [], 0.25)
            if ready:
                for byte in os.read(self._rfd, 64):
                    if byte in STOP_SIGNALS and self.signum is None:
                        self.signum = byte
            if self._done.is_set():
                return
            if (self.signum is not None or self.dead) and self._trouble_since is None:
                self._trouble_since = time.monotonic()
                # A signal: stop the stages now, so a receive the main thread is blocked in fails
                # and the main thread gets back to Python (where the signal handler unwinds it).
                # A dead stage: the others are blocked on it; stopping them fails that receive too.
                self._terminate_stages()
            self._refresh_progress()
            if self._trouble_since is not None and time.monotonic() - self._trouble_since > HARD_EXIT_GRACE_S:
                self._hard_exit()

    def _refresh_progress(self, force: bool = False) -> None:
        """Phase and output tok/s even while no request finishes (a long decode phase); at most once
        per the bar's mininterval, which is long when stderr is a log rather than a terminal."""
        bar, ex, now = self.progress, self.executor, time.monotonic()
        if bar is None or ex is None or (now - self._last_refresh < bar.mininterval and not force):
            return
        self._last_refresh = now
        elapsed = max(bar.format_dict.get("elapsed", 0.0), 1e-9)
        decisions = ex.decisions  # the phase of the batch the policy submitted last
        phase = decisions[-1][0] if decisions else "starting"
        bar.set_postfix_str(f"{phase} | {ex.stats.output_tokens / elapsed:.1f} out tok/s", refresh=True)

    def _hard_exit(self) -> None:
        self._terminate_stages()
        if self.signum is not None:
            why, code = f"stopped by {signal.Signals(self.signum).name}", 128 + self.signum
        else:
            why, code = "; ".join(self.dead + self.stopped), 1
        os.write(
            2,
            f"\nerror: {why}, and the pipeline did not unwind within {HARD_EXIT_GRACE_S:.0f} s; "
            f"finished results are in the output file: rerun with --resume\n".encode(),
        )
        os._exit(code)
