"""One pipeline stage: a contiguous slice of layers with the KV cache of those layers.

Rank 0 is the controller; stage k (0-based) is rank k + 1 and holds layers
`stage_split.model_stage_ranges(config, stages)[k]` (weighted for the LM head the last stage
also runs), or with the phase split both its prefill and its decode range (`PipelineSplit`).
Per batch a stage receives one control message (a `ForwardBatch` whose block tables the
controller owns), receives the previous stage's hidden states, runs its layers (writing its own
KV), and passes hidden states on; the last stage samples (each request with its own parameters,
watching its stop strings: `last_stage`) and sends one token id and stop flag per sequence to the
controller (a held batch's with the next batch's answer: `StageMessage.hold`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.grammar_cache import GrammarCache
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.tdpipe.executor import Phase
from pdserve.tdpipe.runtime.last_stage import HeldRows, LastStageSampler, StageMessage
from pdserve.tdpipe.runtime.stage_split import PipelineSplit, pipeline_split
from pdserve.tdpipe.runtime.stage_split import stage_layer_range as stage_layer_range  # re-exported: its old home
from pdserve.tdpipe.runtime.stage_config import StageConfig as StageConfig  # re-exported: its old home
from pdserve.tdpipe.runtime.wire import ControlInbox, Outbox, send_frame

CONTROLLER_RANK = 0


def stage_device(device: str, rank: int, tensor_parallel_size: int = 1) -> str:
    """A bare `cuda` means N GPUs per stage of N ranks (the device of its rank 0; rank r takes the
    next r-th, engine.parallel.launcher): $LOCAL_RANK's block (a pod or launcher that sets it), else
    stage k's block modulo the visible count. `cuda:N` and `cpu` are taken as given."""
    if device != "cuda":
        return device
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return f"cuda:{int(local) * tensor_parallel_size}"
    import torch.cuda

    return f"cuda:{((rank - 1) * tensor_parallel_size) % max(1, torch.cuda.device_count())}"


def stage_pipeline_split(cfg: StageConfig, model: ModelConfig, num_stages: int) -> PipelineSplit:
    """The split the stages of `cfg` run (ValueError where the phase split cannot run)."""
    split = pipeline_split(model, num_stages, cfg.phase_split)
    if split.by_phase:
        if cfg.device != "cpu" or cfg.tensor_parallel_size != 1:
            raise ValueError("the phase split runs on CPU stages of one rank each (--phase-split off)")
    return split


def stage_runner(cfg: StageConfig, rank: int, model: ModelConfig, split: PipelineSplit) -> ModelRunner:
    """Stage `rank - 1`'s runner over the layers it holds in `split`: one process, or rank 0 of a
    tensor-parallel group whose death of any rank ends this stage process at once (exit 1, the job
    names the stage)."""
    held = split.held(rank - 1)
    options: dict[str, Any] = dict(
        dtype=cfg.dtype,
        device=stage_device(cfg.device, rank, cfg.tensor_parallel_size),
        attention_backend=cfg.attention_backend,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        layer_range=held,
        num_threads=cfg.num_threads,
    )
    if split.by_phase:  # a layer its neighbour also runs: the KV lives in the launcher's shared file
        from pdserve.engine.weights import resolve_dtype
        from pdserve.tdpipe.runtime import shared_kv

        dtype = resolve_dtype(cfg.dtype, model, torch.device("cpu"))
        options["kv_tensor"] = shared_kv.map_layers(cfg.kv_fd, model, cfg.num_kv_blocks, cfg.block_size, dtype, held)
    if cfg.tensor_parallel_size == 1:
        return ModelRunner(Path(cfg.model_dir), **options)
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.parallel.launcher import TensorParallelRunner

    def rank_died(why: str) -> None:
        print(f"error: pipeline stage {rank - 1}: {why}; the stage stops", file=sys.stderr, flush=True)
        os._exit(1)  # rank 0 may be blocked on the controller or a neighbour: no later check would run

    engine = EngineConfig(model_dir=cfg.model_dir, tensor_parallel_size=cfg.tensor_parallel_size, **options)
    return TensorParallelRunner(engine, on_rank_death=rank_died)


@dataclass
class StageTimeline:
    """(start, end, num_tokens, phase) of every batch this stage ran, wall-clock seconds."""

    spans: list[tuple[float, float, int, str]] = field(default_factory=list)


def run_stage(cfg: StageConfig, rank: int, world_size: int) -> StageTimeline:
    """Serve batches until the controller sends None; returns this stage's timeline."""
    model = ModelConfig.from_dir(cfg.model_dir)  # every stage reads the same config.json: one split
    split = stage_pipeline_split(cfg, model, world_size - 1)
    runner = stage_runner(cfg, rank, model, split)
    try:
        return _serve(cfg, runner, rank, split)
    finally:
        runner.close()  # a tensor-parallel stage stops its ranks


def _serve(cfg: StageConfig, runner: ModelRunner, rank: int, split: PipelineSplit) -> StageTimeline:
    hidden_size = runner.model_config.hidden_size
    outbox, timeline = Outbox(), StageTimeline()
    inbox = ControlInbox(CONTROLLER_RANK)  # posts the first receive now: the controller's messages never wait for us
    sampling = LastStageSampler(cfg.model_dir, _grammars(cfg.model_dir, runner)) if runner.is_last_stage else None
    held_rows = HeldRows()
    while True:
        msg = inbox.recv()
        if msg is None:
            break
        assert isinstance(msg, StageMessage), f"unexpected control message {type(msg)}"
        batch = msg.batch
        hidden = None
        if not runner.is_first_stage:
            # hidden: [T, H] from the previous stage
            hidden = torch.empty(batch.num_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(hidden, rank - 1)
        start = time.perf_counter()
        layers = split.span(rank - 1, batch.is_decode_only)
        if sampling is not None:
            final = runner.run(batch, hidden_states=hidden, layers=layers, head=False)
            answer = held_rows.step(msg, final, runner.logits, sampling)
            if answer is not None:  # a held batch's tokens come with the next batch's answer
                outbox.send(answer, CONTROLLER_RANK)
        else:
            outbox.send(runner.run(batch, hidden_states=hidden, layers=layers).contiguous(), rank + 1)
        timeline.spans.append(
            (start, time.perf_counter(), batch.num_tokens, Phase.DECODE if batch.is_decode_only else Phase.PREFILL)
        )
    send_frame(outbox, timeline.spans, [CONTROLLER_RANK])
    outbox.flush()
    return timeline


def _grammars(model_dir: str | Path, runner: ModelRunner) -> GrammarCache:
    """Grammars end at the tokenizer's EOS ids, the ones the batch job stops on (batch_job)."""
    from pdserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    return GrammarCache(tokenizer, runner.model_config.vocab_size, tokenizer.eos_token_ids)


def main_from_env(cfg: StageConfig) -> int:
    """Entry point of `pdserve stage`: rank and world from the torch.distributed env variables."""
    from pdserve.tdpipe.runtime.heartbeat import start_heartbeat
    from pdserve.tdpipe.runtime.wire import init_process_group, rendezvous_store

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if var not in os.environ:
            raise ValueError(f"{var} is not set (pdserve stage is configured by the torch.distributed env variables)")
    if os.environ["RANK"] == str(CONTROLLER_RANK):
        raise ValueError("RANK 0 is the controller (pdserve batch); stages are ranks 1..WORLD_SIZE-1")
    rank, world = init_process_group(cfg.device, cfg.init_timeout)
    beating = start_heartbeat(rendezvous_store(), rank)  # before the model loads: that can take long
    try:
        run_stage(cfg, rank, world)
    finally:
        beating.set()
        dist.destroy_process_group()
    return 0
