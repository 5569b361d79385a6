"""Start a pipeline on this machine: `pdserve stage` processes plus the controller in this process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def run_local_pipeline(cfg: StageConfig, num_stages: int, requests: list[PipeRequest],
                       max_batch_tokens: int = 2048, on_finish=None) -> tuple[RunStats, list]:
    """Run `requests` through `num_stages` local stage processes; returns (stats, stage timelines)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(num_stages + 1))
    procs = [subprocess.Popen(stage_command(cfg), env=dict(env, RANK=str(k + 1))) for k in range(num_stages)]
    try:
        os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}, RANK="0")
        init_process_group(cfg.device)
        controller = PipelineController(num_stages, cfg.num_kv_blocks, cfg.block_size, max_batch_tokens, procs)
        controller.run(requests, on_finish)
        timelines = controller.shutdown()
        for proc in procs:
            proc.wait(timeout=60)
        return controller.stats, timelines
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
