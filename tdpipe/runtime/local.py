"""Start a pipeline on this machine: `pdserve stage` processes plus the controller in this process."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch.distributed as dist

from tdpipe.runtime.controller import PipeRequest, PipelineController, RunStats
from tdpipe.runtime.stage_worker import StageConfig
from tdpipe.runtime.wire import init_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_command(cfg: StageConfig) -> list[str]:
    """The `pdserve stage` command line for `cfg` (rank and world come from the env)."""
    args = [sys.executable, "-m", "pdserve.cli", "stage"]
    for key, value in asdict(cfg).items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


# Resolved here, not in the forked child (a dlopen between fork and exec can deadlock).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """Runs in the stage child before exec: SIGKILL it when the launcher dies, however it dies
    (a SIGKILLed `pdserve batch` cannot clean up; its stages must not linger blocked in gloo)."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


def run_local_pipeline(cfg: StageConfig, num_stages: int, requests: list[PipeRequest],
                       max_batch_tokens: int = 2048, on_finish=None,
                       on_spawn: Callable[[list[subprocess.Popen]], None] | None = None,
                       on_controller: Callable[[PipelineController], None] | None = None) -> tuple[RunStats, list]:
    """Run `requests` through `num_stages` local stage processes; returns (stats, stage timelines).

    `on_spawn(procs)` sees the stage processes as soon as they start (a watchdog can poll them);
    `on_controller(controller)` sees the controller before it runs (progress display).
    """
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(num_stages + 1))
    # Own session: a terminal's Ctrl-C reaches `pdserve batch` only, which stops the stages itself.
    procs = [subprocess.Popen(stage_command(cfg), env=dict(env, RANK=str(k + 1)), start_new_session=True,
                              preexec_fn=_die_with_parent) for k in range(num_stages)]
    try:
        if on_spawn is not None:
            on_spawn(procs)
        os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}, RANK="0")
        return run_controller(cfg, num_stages, requests, max_batch_tokens, on_finish, procs, on_controller)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_controller(cfg: StageConfig, num_stages: int, requests: list[PipeRequest], max_batch_tokens: int = 2048,
                   on_finish=None, stage_procs: Sequence[subprocess.Popen] = (),
                   on_controller: Callable[[PipelineController], None] | None = None) -> tuple[RunStats, list]:
    """Rank 0 of a pipeline whose stages join through MASTER_ADDR/MASTER_PORT/WORLD_SIZE (RANK=0 here).

    Shared by the local launcher above (stages are its children) and `pdserve batch --external-stages`
    (stages are `pdserve stage` processes started elsewhere, e.g. the pods of a Kubernetes Indexed Job).
    """
    try:
        init_process_group(cfg.device)
        controller = PipelineController(num_stages, cfg.num_kv_blocks, cfg.block_size, max_batch_tokens,
                                        list(stage_procs))
        if on_controller is not None:
            on_controller(controller)
        controller.run(requests, on_finish)
        timelines = controller.shutdown()
        for proc in stage_procs:
            proc.wait(timeout=60)
        return controller.stats, timelines
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
