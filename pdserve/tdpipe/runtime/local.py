"""Start a pipeline on this machine: `pdserve stage` processes plus the controller in this process."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.pipeline import SimStats
from pdserve.tdpipe.runtime.controller import PipeRequest, StageExecutor
from pdserve.tdpipe.runtime.stage_worker import StageConfig
from pdserve.tdpipe.runtime.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_S, HeartbeatMonitor
from pdserve.tdpipe.runtime.wire import init_process_group, rendezvous_store
from pdserve.tdpipe.simulator import make_policy

Timelines = list[list[tuple[float, float, int, str]]]
"""Per stage: (start, end, num_tokens, phase) of every batch, time.perf_counter seconds."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_command(cfg: StageConfig) -> list[str]:
    """The `pdserve stage` command line for `cfg` (rank and world come from the env)."""
    args = [sys.executable, "-m", "pdserve.cli", "stage"]
    for key, value in asdict(cfg).items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # a switch: present or not
            args += [flag] if value else []
        else:
            args += [flag, str(value)]
    return args


def run_policy(
    executor: StageExecutor,
    requests: Sequence[PipeRequest],
    *,
    policy: str,
    num_stages: int,
    num_kv_blocks: int,
    block_size: int,
    max_batch_tokens: int,
    table: CostTable | None = None,
) -> SimStats:
    """Drive joined stages with one of the simulator's policy objects (the controller's whole job)."""
    inst = InstanceConfig(
        num_stages=num_stages, capacity_blocks=num_kv_blocks, block_size=block_size, max_batch_tokens=max_batch_tokens
    )
    return make_policy(policy, table or CostTable.analytic(), inst).run(requests, executor)


# Resolved here, not in the forked child (a dlopen between fork and exec can deadlock).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def stop_on_purpose(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a stage as part of stopping the pipeline, marked so (`stopped_on_purpose`) that a
    watchdog noticing its exit does not take it for the stage whose death caused the stop."""
    proc.stopped_on_purpose = True  # type: ignore[attr-defined]
    proc.send_signal(sig)


def stopped_on_purpose(proc: subprocess.Popen) -> bool:
    return getattr(proc, "stopped_on_purpose", False)


def _die_with_parent() -> None:
    """Runs in the stage child before exec: SIGKILL it when the launcher dies, however it dies
    (a SIGKILLed `pdserve batch` cannot clean up; its stages must not linger blocked in gloo)."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


def _shared_kv_file(cfg: StageConfig, num_stages: int) -> int | None:
    """The shared KV file's descriptor when the phase split moves layers between stages (`shared_kv`)."""
    if not cfg.phase_split:
        return None
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.weights import resolve_dtype
    from pdserve.tdpipe.runtime import shared_kv
    from pdserve.tdpipe.runtime.stage_worker import stage_pipeline_split

    model = ModelConfig.from_dir(cfg.model_dir)
    if not stage_pipeline_split(cfg, model, num_stages).by_phase:
        return None  # both phases split alike (a small head): nothing to share
    dtype = resolve_dtype(cfg.dtype, model, torch.device(cfg.device))
    return shared_kv.create(model, cfg.num_kv_blocks, cfg.block_size, dtype)


def run_local_pipeline(
    cfg: StageConfig,
    num_stages: int,
    *args: Any,
    on_spawn: Callable[[list[subprocess.Popen]], None] | None = None,
    **kwargs: Any,
) -> tuple[SimStats, Timelines]:
    """`run_controller(cfg, num_stages, *args, **kwargs)` over `num_stages` stage processes started
    here as its children (`stage_procs`): runs the requests under the policy and returns (stats, stage
    timelines). `on_spawn(procs)` sees the stage processes as soon as they start (a watchdog polls them)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(num_stages + 1))
    kv_fd = _shared_kv_file(cfg, num_stages)
    if kv_fd is not None:
        cfg = replace(cfg, kv_fd=kv_fd)
    try:
        # Own session: a terminal's Ctrl-C reaches the launcher only, which stops the stages itself.
        procs = [
            subprocess.Popen(
                stage_command(cfg),
                env=dict(env, RANK=str(k + 1)),
                start_new_session=True,
                preexec_fn=_die_with_parent,
                pass_fds=() if kv_fd is None else (kv_fd,),
            )
            for k in range(num_stages)
        ]
    finally:
        if kv_fd is not None:  # the stages hold it now: the memory goes when the last of them exits
            os.close(kv_fd)
    try:
        if on_spawn is not None:
            on_spawn(procs)
        os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}, RANK="0")
        return run_controller(cfg, num_stages, *args, stage_procs=procs, **kwargs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_on_purpose(proc)
                proc.wait()


def run_controller(
    cfg: StageConfig,
    num_stages: int,
    requests: Sequence[PipeRequest],
    max_batch_tokens: int = 2048,
    on_finish: Callable[[PipeRequest], None] | None = None,
    *,
    policy: str = "tdpipe",
    table: CostTable | None = None,
    decisions: list | None = None,
    stage_procs: Sequence[subprocess.Popen] = (),
    on_executor: Callable[[StageExecutor], None] | None = None,
    on_stall: Callable[[int, float], None] | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> tuple[SimStats, Timelines]:
    """Rank 0 of a pipeline whose stages join through MASTER_ADDR/MASTER_PORT/WORLD_SIZE (RANK=0 here):
    runs `requests` through the `num_stages` stages under `policy` (tdpipe | pp-sb | pp-hb, or any
    simulator policy name). `table` is the cost table the TD-Pipe switch decisions read (default: the
    analytic one). Returns (stats, stage timelines); `decisions`, when given, receives the executor's
    decision log; `on_executor(executor)` sees the executor before the policy runs (progress display).
    `on_stall(rank, silent_s)` is called (from a monitor thread) when a stage's heartbeat has been
    silent for `heartbeat_timeout` s (`tdpipe.runtime.heartbeat`); it must unblock or end the job.

    Shared by the local launcher above (the stages are its children, `stage_procs`) and
    `pdserve batch --external-stages` (`pdserve stage` ranks started elsewhere, e.g. the pods
    of a Kubernetes Indexed Job).
    """
    monitor = None
    try:
        init_process_group(cfg.device, cfg.init_timeout)
        if on_stall is not None:
            monitor = HeartbeatMonitor(rendezvous_store(), num_stages, heartbeat_timeout, on_stall)
        executor = StageExecutor(num_stages, cfg.num_kv_blocks, cfg.block_size, list(stage_procs), on_finish)
        if on_executor is not None:
            on_executor(executor)
        stats = run_policy(
            executor,
            requests,
            policy=policy,
            num_stages=num_stages,
            num_kv_blocks=cfg.num_kv_blocks,
            block_size=cfg.block_size,
            max_batch_tokens=max_batch_tokens,
            table=table,
        )
        if decisions is not None:
            decisions.extend(executor.decisions)
        timelines = executor.shutdown()
        if monitor is not None:
            monitor.close()  # the stages stop beating as they exit
        for proc in stage_procs:
            proc.wait(timeout=60)
        return stats, timelines
    finally:
        if monitor is not None:
            monitor.close()
        if dist.is_initialized():
            dist.destroy_process_group()
