"""Liveness of the batch pipeline: the rendezvous times out, a silent stage's heartbeat is noticed
within the documented bound (tdpipe/runtime/heartbeat.py), and a SIGSTOPped stage is named, the job
exits 1 and `--resume` finishes it.

Stores listen on 127.0.0.1 only; every test stops what it started and polls with deadlines.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pdserve.tdpipe.runtime import wire
from pdserve.tdpipe.runtime.heartbeat import HeartbeatMonitor, start_heartbeat
from tests.e2e.router_cluster import free_port
from tests.tdpipe.batch_helpers import STOP_TIMEOUT, all_gone, kill_job
from tests.tdpipe.test_batch_interrupts import finish_and_check, start_mid_run


def test_rendezvous_times_out_naming_the_missing_ranks(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # two stage ranks that never come
    t0 = time.monotonic()
    with pytest.raises(wire.RendezvousTimeout, match=r"all 2 stage ranks did not join .* within 1 s"):
        wire.init_process_group("cpu", timeout_s=1.0)
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()


def test_a_silent_stage_is_reported_within_the_bound_and_a_beating_one_never() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    stalls: list[tuple[int, float, float]] = []
    reported = threading.Event()
    interval, timeout = 0.1, 1.0

    def on_stall(rank: int, silent: float) -> None:
        stalls.append((rank, silent, time.monotonic()))
        reported.set()

    beats = {rank: start_heartbeat(store, rank, interval_s=interval) for rank in (1, 2)}
    monitor = HeartbeatMonitor(store, 2, timeout, on_stall, interval_s=interval)
    try:
        time.sleep(1.5)  # longer than the timeout: both beat, nothing is reported
        assert not stalls
        stopped_at = time.monotonic()
        beats[2].set()  # rank 2 goes silent, as a SIGSTOPped stage does
        assert reported.wait(10)
        (rank, silent, when), *_ = stalls
        assert rank == 2 and silent > timeout
        assert when - stopped_at <= timeout + 2 * interval + 0.5  # the bound, with scheduling slack
        assert monitor.last_beat_age()[1] < timeout  # rank 1 still beats
    finally:
        monitor.close()
        for done in beats.values():
            done.set()


def test_heartbeat_timeout_must_exceed_the_interval() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    with pytest.raises(ValueError, match="heartbeat-timeout"):
        HeartbeatMonitor(store, 1, 0.5, lambda rank, s: None)


@pytest.mark.slow  # 40-90 s: a tiny-model job run twice plus engine.LLM for the reference texts
def test_a_sigstopped_stage_is_named_and_the_job_resumes(tmp_path, tiny_model_dir) -> None:
    timeout = 8
    proc, stages, expected = start_mid_run(tmp_path, tiny_model_dir, "--heartbeat-timeout", str(timeout))
    try:
        stopped_at = time.monotonic()
        os.kill(stages[1], signal.SIGSTOP)  # alive but silent: no exit for the watchdog to see
        _, err = proc.communicate(timeout=STOP_TIMEOUT + timeout)
        took = time.monotonic() - stopped_at
        assert proc.returncode == 1, err
        assert f"pipeline stage stalled: stage rank 2 (pid {stages[1]}) stopped answering" in err, err
        assert "--resume" in err
        assert took > timeout  # not before its heartbeat had been silent that long
        assert all_gone(stages, time.monotonic() + STOP_TIMEOUT), "a stage was left behind"
    finally:
        for pid in stages:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_job(proc)
    finish_and_check(tmp_path, expected)
