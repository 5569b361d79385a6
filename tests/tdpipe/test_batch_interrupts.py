"""`pdserve batch` interrupted: killed, stopped by a signal, or a stage killed; it stops its stages
and a `--resume` run answers each id once. And the watchdog that ends a job whose main thread hangs.

Processes listen on 127.0.0.1 only; every test stops what it started and polls with deadlines
(generous: the CI machine has 2 loaded cores), never asserting speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.tdpipe.batch_helpers import (
    PROMPTS,
    START_TIMEOUT,
    STOP_TIMEOUT,
    all_gone,
    batch_cmd,
    kill_job,
    read_results,
    request_line,
    stage_pids,
    texts_by_id,
)


def start_mid_run(tmp_path: Path, llm_dir, *extra: str) -> tuple[subprocess.Popen, list[int], dict[str, str]]:
    """Start a job (`extra` flags) whose requests retire one by one; return it once the first result is written."""
    # staggered lengths: requests retire one by one, so what comes after the first result lands mid-job
    lengths = {f"r{i}": 2 + 10 * i for i in range(len(PROMPTS))}
    llm = LLM(llm_dir)
    expected = {
        cid: llm.generate(PROMPTS[i], SamplingParams(max_tokens=lengths[cid], temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .text
        for i, cid in enumerate(lengths)
    }
    del llm
    (tmp_path / "in.jsonl").write_text(
        "\n".join(request_line(cid, PROMPTS[i], max_tokens=n) for i, (cid, n) in enumerate(lengths.items())) + "\n"
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(batch_cmd(tmp_path, *extra), stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    stages = stage_pids(proc.pid, 2, deadline)
    while proc.poll() is None and time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n")):
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    return proc, stages, expected


def finish_and_check(tmp_path: Path, expected: dict[str, str]) -> None:
    out = tmp_path / "out.jsonl"
    assert 0 < len(out.read_text().splitlines()) < len(PROMPTS), "the interruption should land mid-job"
    resumed = subprocess.run(batch_cmd(tmp_path, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    rows = read_results(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(expected)  # each exactly once
    assert texts_by_id(rows) == expected


@pytest.mark.slow  # 35-80 s: a tiny-model job run twice plus engine.LLM for the reference texts
def test_batch_killed_then_resumed_answers_each_id_once(tmp_path, tiny_model_dir) -> None:
    proc, stages, expected = start_mid_run(tmp_path, tiny_model_dir)
    try:
        proc.kill()  # SIGKILL the job alone, as a crash would: its stages must not outlive it
        proc.wait(timeout=STOP_TIMEOUT)
        assert all_gone(stages, time.monotonic() + STOP_TIMEOUT), "stage processes outlived a killed job"
    finally:
        kill_job(proc)
    with (tmp_path / "out.jsonl").open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r')  # a line torn by the kill
    finish_and_check(tmp_path, expected)


@pytest.mark.slow  # 35-80 s: as above
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_batch_stopped_by_signal_stops_its_stages_and_resumes(tmp_path, tiny_model_dir, sig) -> None:
    proc, stages, expected = start_mid_run(tmp_path, tiny_model_dir)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 128 + sig, err
        assert "--resume" in err
        assert all_gone(stages, time.monotonic() + STOP_TIMEOUT), "stage processes left behind"
    finally:
        kill_job(proc)
    finish_and_check(tmp_path, expected)


@pytest.mark.slow  # 35-80 s: as above
def test_batch_names_a_killed_stage_then_resumes(tmp_path, tiny_model_dir) -> None:
    proc, stages, expected = start_mid_run(tmp_path, tiny_model_dir)
    try:
        os.kill(stages[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)  # no hang: the job notices within the timeout
        assert proc.returncode == 1, err
        assert f"pipeline stage died: stage rank 2 (pid {stages[1]}) was killed by SIGKILL" in err, err
        assert all_gone(stages, time.monotonic() + STOP_TIMEOUT), "the surviving stage was left behind"
    finally:
        kill_job(proc)
    finish_and_check(tmp_path, expected)


WATCHDOG_SCRIPT = """
import subprocess, sys, threading
import pdserve.tdpipe.runtime.batch_watchdog as bj
bj.HARD_EXIT_GRACE_S = 1.0
wd = bj.StageWatchdog()
wd.install()
stages = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
wd.watch(stages)
print(" ".join(str(p.pid) for p in stages), flush=True)
lock = threading.Lock()
lock.acquire()
lock.acquire()  # a main thread that never returns to Python, like one stuck in a gloo receive
"""


def test_watchdog_ends_a_job_whose_main_thread_stays_blocked() -> None:
    """The last resort: a stage died and the main thread does not unwind. The watchdog stops the
    other stages and ends the process with exit 1, naming the dead stage."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 1, err
        assert f"stage rank 2 (pid {pids[1]}) was killed by SIGKILL" in err and "--resume" in err, err
        assert all_gone(pids, time.monotonic() + STOP_TIMEOUT), "the other stage was left running"
    finally:
        kill_job(proc)


def test_watchdog_names_the_stage_that_died_not_the_ones_stopped_after_it() -> None:
    """The launcher kills the survivors right after a stage dies; their waiter threads may notice those
    exits first. Here the survivor's exit is noticed first, for certain: it still must not be named."""
    from pdserve.tdpipe.runtime.batch_watchdog import StageWatchdog
    from pdserve.tdpipe.runtime.local import stop_on_purpose

    wd = StageWatchdog()
    stages = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        wd.watch(stages)
        stop_on_purpose(stages[0])  # rank 1, stopped by the launcher
        deadline = time.monotonic() + 30
        while not wd.stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert wd.stopped and not wd.dead
        os.kill(stages[1].pid, signal.SIGKILL)  # rank 2 dies on its own, noticed second
        dead = wd.wait_for_dead(timeout=30)
        assert dead[0] == f"stage rank 2 (pid {stages[1].pid}) was killed by SIGKILL", dead
        assert dead[1:] == [f"stage rank 1 (pid {stages[0].pid}) was killed by SIGKILL"]
    finally:
        for p in stages:
            p.kill()
            p.wait()
