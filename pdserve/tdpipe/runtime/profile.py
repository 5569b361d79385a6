"""Profile the real pipeline stages and turn the profile into a simulator `CostTable`.

Each stage is profiled the way a `pdserve stage` process runs it: a `ModelRunner` over the
stage's layer slice (`stage_split.pipeline_split`: each phase on its own range under the phase
split), the same torch thread count, the same attention backend, the last stage's logits and
greedy argmax included. CPU stages are timed side by side, one process each, every forward
started on all of them at once (`_profile_together`), as they compute in a full pipeline.
Hidden states sent between stages and the controller's messages are not part of a stage's
forward time, exactly as a stage's own timeline spans (`stage_worker.run_stage`) exclude them.

The profile becomes the simulator's table in `profile_table` (`build_cost_table`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.weights import resolve_dtype
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.runtime.profile_comm import measure_overheads
from pdserve.tdpipe.runtime.profile_plan import ProfilePlan as ProfilePlan  # re-exported: callers import the plan here
from pdserve.tdpipe.runtime.profile_plan import max_decode_batch as max_decode_batch
from pdserve.tdpipe.runtime.profile_plan import mean_decode_context as mean_decode_context
from pdserve.tdpipe.runtime.profile_plan import plan_profile as plan_profile
from pdserve.tdpipe.runtime.profile_table import StageProfile as StageProfile  # re-exported, as the plan
from pdserve.tdpipe.runtime.profile_table import build_cost_table as build_cost_table
from pdserve.tdpipe.runtime.profile_table import monotone as monotone
from pdserve.tdpipe.runtime.stage_split import pipeline_split


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def decode_batch(batch_size: int, context: int, block_size: int, vocab_size: int) -> ForwardBatch:
    """A decode step of `batch_size` requests with `context` KV tokens each, on distinct blocks
    (aliasing the blocks would keep the KV in cache and understate the attention cost)."""
    per_seq = _blocks(context, block_size)
    return ForwardBatch(
        request_ids=[f"d{i}" for i in range(batch_size)],
        input_ids=[(17 + i) % vocab_size for i in range(batch_size)],
        query_lens=[1] * batch_size,
        context_lens=[context] * batch_size,
        block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size)],
        sample_mask=[True] * batch_size,
    )


def decode_kv_context(decode_context: int) -> int:
    """The second KV length decode steps are timed at, for the KV slope: twice the first."""
    return max(2 * decode_context, decode_context + 1)


def prefill_batch(num_tokens: int, prompt_len: int, block_size: int, vocab_size: int) -> ForwardBatch:
    """Whole prompts of `prompt_len` tokens (the last one shorter) totalling `num_tokens`."""
    lens = [prompt_len] * (num_tokens // prompt_len) + ([num_tokens % prompt_len] if num_tokens % prompt_len else [])
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + _blocks(n, block_size))))
        next_block += _blocks(n, block_size)
    return ForwardBatch(
        request_ids=[f"p{i}" for i in range(len(lens))],
        input_ids=[(31 + i) % vocab_size for i in range(num_tokens)],
        query_lens=lens,
        context_lens=lens,
        block_tables=tables,
        sample_mask=[True] * len(lens),
    )


def _time_ms(
    runner: ModelRunner,
    batch: ForwardBatch,
    hidden: torch.Tensor | None,
    repeats: int,
    layers: tuple[int, int],
    sync: Callable[[], object],
) -> float:
    times = []
    on_gpu = runner.device.type == "cuda"
    for _ in range(repeats + 1):  # the first run warms caches and allocator; dropped
        if on_gpu:
            torch.cuda.synchronize(runner.device)
        sync()  # profiled together: every stage starts this forward at once
        t0 = time.perf_counter()
        out = runner.run(batch, hidden_states=hidden, layers=layers)
        if runner.is_last_stage:
            out = out.argmax(dim=-1)  # the stage worker samples greedily inside its span
        if on_gpu:  # kernels are asynchronous: the forward ends when the device says so
            torch.cuda.synchronize(runner.device)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times[1:])


@dataclass(frozen=True)
class _StageJob:
    """What one stage's profile needs (picklable: a concurrent profile sends it to a process)."""

    model_dir: str
    stage: int
    num_stages: int
    phase_split: bool
    decode_batches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    decode_context: int
    prefill_prompt_len: int
    block_size: int
    num_kv_blocks: int
    num_threads: int
    dtype: str
    repeats: int
    attention_backend: str
    device: str


def _profile_stage(job: _StageJob, sync: Callable[[], object] = lambda: None) -> StageProfile:
    """Time one stage's forwards; `sync()` runs before each (a barrier shared with the other stages)."""
    cfg = ModelConfig.from_dir(job.model_dir)
    split = pipeline_split(cfg, job.num_stages, job.phase_split)
    runner = ModelRunner(
        job.model_dir,
        dtype=job.dtype,
        device=job.device,
        block_size=job.block_size,
        num_kv_blocks=job.num_kv_blocks,
        layer_range=split.held(job.stage),
        num_threads=job.num_threads,
        attention_backend=job.attention_backend,
    )
    runner.attention.wait_ready()  # a first-use kernel build is not a forward time
    prof = StageProfile(job.stage, split.held(job.stage), job.decode_context, prefill_prompt_len=job.prefill_prompt_len)

    def hidden(n: int) -> torch.Tensor | None:
        if runner.is_first_stage:
            return None
        return torch.randn(n, cfg.hidden_size, dtype=runner.dtype, device=runner.device) * 0.1

    decode_layers, prefill_layers = split.span(job.stage, True), split.span(job.stage, False)
    for b in job.decode_batches:
        batch = decode_batch(b, job.decode_context, job.block_size, cfg.vocab_size)
        prof.decode_ms[b] = _time_ms(runner, batch, hidden(b), job.repeats, decode_layers, sync)
    # The KV slope: the largest batch again at twice the KV length. Every sequence of a step reads
    # its own KV, so a phase's last steps (the long outputs, often over long prompts) cost more than
    # the mean length's (bench stage 0, 12 sequences: 20 ms at 100 tokens each, 37 ms at 1000).
    b, long_ctx = max(job.decode_batches), decode_kv_context(job.decode_context)
    batch = decode_batch(b, long_ctx, job.block_size, cfg.vocab_size)
    slow = _time_ms(runner, batch, hidden(b), job.repeats, decode_layers, sync)
    prof.decode_kv_ms = max(0.0, (slow - prof.decode_ms[b]) / (b * (long_ctx - job.decode_context)))
    for n in job.prefill_tokens:
        batch = prefill_batch(n, job.prefill_prompt_len, job.block_size, cfg.vocab_size)
        prof.prefill_ms[n] = _time_ms(runner, batch, hidden(n), job.repeats, prefill_layers, sync)
    return prof


def _stage_process(job: _StageJob, barrier: Any, results: Any) -> None:
    """A concurrent profile's stage process: its profile (or its error) goes to `results`."""
    try:
        results.put((job.stage, _profile_stage(job, barrier.wait)))
    except BaseException as e:  # reported to the parent, which raises it
        barrier.abort()  # the other stages stop waiting for this one
        results.put((job.stage, f"{type(e).__name__}: {e}"))


def _profile_together(jobs: list[_StageJob]) -> list[StageProfile]:
    """Every stage in its own process, each forward started at once on all of them (a barrier):
    the stages of a pipeline compute side by side, sharing the memory bus and the cores' clocks,
    and a stage timed alone ran up to 23% faster than in the job (bench decode, 2026-11-26)."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # no fork of a process that may hold OpenMP threads
    barrier, results = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_stage_process, args=(job, barrier, results), daemon=True) for job in jobs]
    for proc in procs:
        proc.start()
    got: dict[int, StageProfile] = {}
    errors: dict[int, str] = {}
    exited: dict[int, float] = {}  # when a process was first seen gone without a word
    try:
        while len(got) + len(errors) < len(jobs):
            try:
                stage, result = results.get(timeout=1.0)
            except queue_mod.Empty:
                now = time.monotonic()
                for k, proc in enumerate(procs):
                    if proc.exitcode is not None and k not in got and k not in errors:
                        # its last message may still be in the pipe: give it a few seconds
                        if now - exited.setdefault(k, now) > 5.0:
                            errors[k] = f"its process exited with code {proc.exitcode}"
                continue
            if isinstance(result, str):
                errors[stage] = result
            else:
                got[stage] = result
    finally:
        barrier.abort()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:  # the stage that failed first, not the ones it left waiting at the barrier
        stage = min(errors, key=lambda k: "BrokenBarrierError" in errors[k])
        raise RuntimeError(f"profiling stage {stage}: {errors[stage]}")
    return [got[k] for k in range(len(jobs))]


def profile_stages(
    model_dir: str | Path,
    num_stages: int,
    *,
    decode_batches: list[int],
    prefill_tokens: list[int],
    decode_context: int,
    prefill_prompt_len: int = 256,
    block_size: int = 16,
    num_threads: int = 1,
    dtype: str = "auto",
    repeats: int = 3,
    attention_backend: str = "auto",
    device: str = "cpu",
    phase_split: bool = False,
    together: bool | None = None,
) -> list[StageProfile]:
    """Time every stage's slice on decode batches and prefill batches (see the module docstring);
    with `phase_split`, each phase on its own split (`stage_split.pipeline_split`).

    Each stage with `num_threads` torch threads, as a stage process runs. `together` (default: on
    CPU with several stages) times the stages side by side in one process each, every forward
    started on all of them at once, as a full pipeline runs them; otherwise one stage at a time in
    this process (on `device`: CUDA timings synchronise the device; not exercised on a GPU here).
    `attention_backend` must be what the stages use ("auto", as `StageConfig` gives them) for a
    faithful table; tests pass "torch" to skip the C++ kernel's first-use build.
    """
    if not decode_batches or not prefill_tokens:
        raise ValueError("need at least one decode batch size and one prefill token count")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    need_blocks = max(
        max(decode_batches) * _blocks(decode_kv_context(decode_context), block_size),
        max(prefill_tokens) // block_size + max(prefill_tokens) // max(1, prefill_prompt_len) + 2,
    )
    jobs = [
        _StageJob(
            str(model_dir),
            stage,
            num_stages,
            phase_split,
            tuple(sorted(set(decode_batches))),
            tuple(sorted(set(prefill_tokens))),
            decode_context,
            prefill_prompt_len,
            block_size,
            need_blocks,
            num_threads,
            dtype,
            repeats,
            attention_backend,
            device,
        )
        for stage in range(num_stages)
    ]
    if together is None:
        together = num_stages > 1 and torch.device(device).type == "cpu"
    previous_threads = torch.get_num_threads()
    try:
        if together:
            profiles = _profile_together(jobs)
        else:
            profiles = []
            for job in jobs:
                profiles.append(_profile_stage(job))
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()  # the stages load right after: give their memory back
        stage_dtype = resolve_dtype(dtype, cfg, torch.device(device))  # what the hand-offs carry
        if num_stages > 1:  # hidden states cross stage boundaries; gloo moves them through CPU memory
            handoff, dispatch = measure_overheads(
                cfg.hidden_size,
                stage_dtype,
                sorted(set(decode_batches) | set(prefill_tokens)),
                decode_batches,
                decode_context,
                block_size,
                prefill_tokens=max(prefill_tokens),
                prompt_len=prefill_prompt_len,
            )
            for prof in profiles[:-1]:
                prof.handoff_ms = dict(handoff)
        else:
            _, dispatch = measure_overheads(cfg.hidden_size, stage_dtype, [1], decode_batches, decode_context)
        profiles[0].dispatch_ms = dispatch
    finally:
        torch.set_num_threads(previous_threads)
    return profiles


def profile_at(model_dir: str | Path, num_stages: int, plan: ProfilePlan, **options) -> list[StageProfile]:
    """`profile_stages` at `plan`'s points; `options` are its keyword options (block_size,
    num_threads, dtype, repeats, attention_backend, device, phase_split)."""
    return profile_stages(
        model_dir,
        num_stages,
        decode_batches=plan.decode_batches,
        prefill_tokens=plan.prefill_tokens,
        decode_context=plan.decode_context,
        prefill_prompt_len=plan.prefill_prompt_len,
        **options,
    )


def profiled_table(
    model_dir: str | Path, num_stages: int, plan: ProfilePlan, *, name: str = "profiled", **options
) -> CostTable:
    """Profile the stages at `plan`'s points (`options` as `profile_at`) and build the table the
    policies schedule on."""
    return build_cost_table(profile_at(model_dir, num_stages, plan, **options), name, decode_max=plan.decode_max)
