"""Rank 0 of a tensor-parallel engine: starts ranks 1..N-1 as child processes and drives them.

The ranks start together (rank 0 hosts the rendezvous and waits, bounded, for every rank to join)
and stop together: `close` sends the stop step, and each child also exits when its stdin, a pipe
from rank 0, reaches EOF, so rank 0's death by any signal ends every rank. A child's death is
noticed by a watcher thread at once: the other children are killed and the runner raises
RankFailure at its next call (`check`, called by an idle node loop too) or in the collective it
was in, which gloo fails as soon as the peer's sockets close. Nothing is left behind and nothing
hangs: the node dies as a whole and `pdserve up` restarts it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from typing import Any, Callable

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import RankFailure, TPGroup, rendezvous
from pdserve.engine.parallel.rank_commands import RankCommands
from pdserve.engine.parallel.sharding import TPShard

log = logging.getLogger("pdserve.engine.tp")

START_TIMEOUT_S = 120.0
"""How long rank 0 waits for the other ranks to join (their start-up: python, torch, the model)."""


def rank_spec(config: EngineConfig, rank: int, port: int, reply_fd: int | None = None) -> dict:
    """What a child rank is started with: the engine config, its rank, the rendezvous port and the
    pipe its side service replies on (`rank_commands`)."""
    fields = asdict(config)
    fields["model_dir"] = str(config.model_dir)
    return {"config": fields, "rank": rank, "port": port, "reply_fd": reply_fd}


def rank_options(config: EngineConfig, rank: int) -> dict:
    """ModelRunner options of `rank`: on CUDA its own GPU (`cuda:k` -> `cuda:k+rank`); on CPU,
    unless --num-threads says otherwise, the host's cores shared out so the ranks do not
    oversubscribe them."""
    options = config.runner_options()
    if config.device.startswith("cuda"):
        base = int(config.device.split(":")[1]) if ":" in config.device else 0
        options["device"] = f"cuda:{base + rank}"
    elif not config.num_threads:
        options["num_threads"] = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return options


class RankProcesses:
    """Child processes of ranks 1..N-1; `dead` names the first that exited unasked, and
    `on_death(dead)`, when given, is called (from the watcher thread) once the others are stopped."""

    def __init__(self, config: EngineConfig, port: int, on_death: Callable[[str], None] | None = None) -> None:
        self.dead: str | None = None
        self._on_death = on_death
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        self.commands = RankCommands()
        """Rank 0's commands to the ranks' side services (`EngineConfig.rank_service`)."""
        for rank in range(1, config.tensor_parallel_size):
            reply_read, reply_write = os.pipe()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.parallel.worker"],
                stdin=subprocess.PIPE,
                env=dict(os.environ),
                pass_fds=(reply_write,),
            )
            os.close(reply_write)  # the child holds the only write end: its exit is our EOF
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(rank_spec(config, rank, port, reply_write)) + "\n").encode())
            proc.stdin.flush()  # the pipe stays open: its EOF is rank 0's death
            self.procs.append(proc)
            self.commands.attach(rank, proc.stdin, reply_read)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"tp-rank-{rank}").start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        if self.dead is None:
            self.dead = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            log.critical("%s: stopping every rank of this engine", self.dead)
        self.stop(grace_s=0.0)
        if self._on_death is not None:
            self._on_death(self.dead)

    def expect_exit(self) -> None:
        """The children are about to exit on purpose (the stop step): not a death to report."""
        self._stopping = True

    def stop(self, grace_s: float = 10.0) -> None:
        """Close every child's lifeline, wait up to `grace_s`, then kill what is left."""
        self._stopping = True
        for proc in self.procs:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner: owns the other ranks' processes, sends them each batch it runs.

    `on_rank_death` (RankProcesses) is for a caller that blocks where `check` cannot run, e.g. a
    pipeline stage waiting on its controller: it ends the process instead of waiting to notice."""

    def __init__(self, config: EngineConfig, on_rank_death: Callable[[str], None] | None = None) -> None:
        TPShard(0, config.tensor_parallel_size, config.enable_expert_parallel).check(
            ModelConfig.from_dir(config.model_dir)
        )  # before any spawn
        options = rank_options(config, 0)
        store = rendezvous(0, config.tensor_parallel_size, 0, START_TIMEOUT_S)
        self.ranks = RankProcesses(config, store.port, on_rank_death)
        try:
            tp = TPGroup(
                0,
                config.tensor_parallel_size,
                store,
                torch.device(options["device"]),
                config.dist_timeout,
                start_timeout_s=START_TIMEOUT_S,
            )
            super().__init__(config.model_dir, **options, tp=tp)
        except BaseException as e:
            self.ranks.stop(grace_s=2.0)
            if isinstance(e, RankFailure) or self.ranks.dead:
                raise RankFailure(f"tensor-parallel start failed: {self.ranks.dead or e}") from e
            raise

    def check(self) -> None:
        if self.ranks.dead is not None:
            raise RankFailure(self.ranks.dead)

    def run(self, batch: ForwardBatch, **kwargs: Any) -> torch.Tensor:
        self.check()
        try:
            return super().run(batch, **kwargs)
        except RankFailure as e:
            self.ranks.stop(grace_s=0.0)
            raise RankFailure(f"{self.ranks.dead or 'a tensor-parallel rank failed'}: {e}") from e

    def close(self) -> None:
        # before the stop step: a rank exiting on it must not read as a death (on_rank_death would
        # end a pipeline stage that finished its job)
        self.ranks.expect_exit()
        try:
            if self.ranks.dead is None:
                super().close()
        except RankFailure:
            pass  # a rank died meanwhile: stop() below ends the rest
        self.ranks.stop()
