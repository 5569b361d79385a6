"""The supervisor of `pdserve up`: backoff, restart on the same port, crash-loop detection, bounded log tail."""

from __future__ import annotations

import os
import sys
import time

from pdserve.node_runtime.supervisor import LOG_TAIL_LINES, RestartPolicy, Supervised, Supervisor


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_and_a_crash_loop_is_max_restarts_within_the_window():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=3, window=60.0, base_delay=0.5, max_delay=4.0, clock=clock)
    delays = []
    for _ in range(3):
        assert not policy.crash_looping()
        delays.append(policy.next_delay())
        policy.record()
        clock.now += 1.0
    assert delays == [0.5, 1.0, 2.0]
    assert policy.crash_looping()
    clock.now += 61.0  # old restarts leave the window: a node that died rarely is restarted again
    assert not policy.crash_looping() and policy.next_delay() == 0.5


def poll_until(supervisor: Supervisor, pred, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reason = supervisor.poll()
        if pred(reason):
            return reason
        time.sleep(0.05)
    raise AssertionError("supervisor did not reach the expected state")


def test_dead_process_is_restarted_on_its_port_then_a_crash_loop_stops():
    ports: list[int] = []

    def command(port: int) -> list[str]:
        ports.append(port)
        # prints many lines (the tail must stay bounded), then READY, then dies
        return [
            sys.executable,
            "-c",
            f"[print(i) for i in range({LOG_TAIL_LINES * 3})]; print('READY x 127.0.0.1:{port}', flush=True)",
        ]

    logs: list[str] = []
    m = Supervised("node", command, 4321, {}, RestartPolicy(max_restarts=2, window=60.0, base_delay=0.01))
    supervisor = Supervisor([m], log=logs.append)
    m.start()
    assert m.wait_ready(time.monotonic() + 30) == "127.0.0.1:4321"
    reason = poll_until(supervisor, lambda r: r is not None)
    assert "crash loop" in reason and "READY x" in reason
    assert ports == [4321, 4321, 4321] and supervisor.num_restarts == 2
    assert sum("restarting it on port 4321" in x for x in logs) == 2
    assert len(m.child.lines) == LOG_TAIL_LINES
    supervisor.stop()


def test_children_die_with_a_killed_supervisor():
    """`up` killed with SIGKILL must not leave nodes behind holding their ports."""
    import os
    import signal
    import subprocess

    code = (
        "import sys, time; from pdserve.node_runtime.supervisor import Child; "
        "c = Child('x', [sys.executable, '-c', "
        "'import time; print(\"READY x 1\", flush=True); time.sleep(60)'], {}); "
        "c.wait_ready(time.monotonic() + 30); print(c.popen.pid, flush=True); time.sleep(60)"
    )
    sup = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(sup.stdout.readline())
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child_pid, signal.SIGKILL)
            raise AssertionError("the child outlived its supervisor")
    finally:
        if sup.poll() is None:
            sup.kill()


def test_a_pinned_member_runs_on_its_cpus_and_keeps_them_across_a_restart():
    one = frozenset({min(os.sched_getaffinity(0))})
    script = "import os; print('READY x:1', sorted(os.sched_getaffinity(0)), flush=True); import time; time.sleep(60)"
    member = Supervised("pinned", lambda port: [sys.executable, "-c", script], 0, dict(os.environ), cpus=one)
    supervisor = Supervisor([member], log=lambda msg: None)
    try:
        for _ in range(2):  # the first child, then the one started after it is killed
            child = member.start()
            child.wait_ready(time.monotonic() + 30)
            assert os.sched_getaffinity(child.popen.pid) == one
            assert f"{sorted(one)}" in child.tail()
            child.stop()
        free = Supervised("free", lambda port: [sys.executable, "-c", script], 0, dict(os.environ))
        supervisor.members.append(free)
        child = free.start()
        child.wait_ready(time.monotonic() + 30)
        assert os.sched_getaffinity(child.popen.pid) == os.sched_getaffinity(0)  # unpinned: inherits ours
    finally:
        supervisor.stop()


def test_a_child_killed_before_ready_says_by_which_signal():
    """The OOM killer's SIGKILL leaves no output: the start error must still say what happened."""
    import pytest

    from pdserve.node_runtime.supervisor import Child

    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    child = Child("silent", [sys.executable, "-c", script], dict(os.environ))
    with pytest.raises(RuntimeError, match=r"silent failed to start \(exited with signal SIGKILL\)"):
        child.wait_ready(time.monotonic() + 30)
    hung = Child("hung", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    try:
        with pytest.raises(RuntimeError, match=r"hung failed to start \(still not ready at the deadline\)"):
            hung.wait_ready(time.monotonic() + 0.5)
    finally:
        hung.stop()
