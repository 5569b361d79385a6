"""Profile the real pipeline stages and turn the profile into a simulator `CostTable`.

Each stage is profiled in this process the way a `pdserve stage` process runs it:
a `ModelRunner` over the stage's layer slice (`stage_split.pipeline_split`: each phase on its own
range under the phase split), the same torch
thread count, the same attention backend, the last stage's logits and greedy argmax
included. Hidden states sent between stages and the controller's messages are
not part of a stage's forward time, exactly as a stage's own timeline spans
(`stage_worker.run_stage`) exclude them.

Mapping onto the simulator (read `tdpipe/cost_table.py` and `tdpipe/pipeline.py`):
`CostTable.stage_ms(n, S) = forward_ms(n) / S`, and the simulated pipeline is a
flow shop of S *equal* stages. The real stages are not equal (the last one also
runs the LM head; the split weighs it, `stage_split`, but moves whole layers), and
in a pipeline kept full the slowest stage sets the pace,
so a table entry is `S * max_k stage_k(n)`: `stage_ms` then returns the
bottleneck stage's measured time. The table has one token dimension for both
phases, so it holds the decode curve (a step of a batch of `n` requests, measured
at one representative KV length — a real decode step grows with the KV length,
the table cannot) for `n` up to a cut, the largest decode batch the policies
form, and the prefill curve (`n` prompt tokens in whole prompts) above it; a
running max keeps the table non-decreasing where the two curves meet. Prefill
batches below the cut are priced as decode steps (dearer per token on a CPU).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from tdpipe.cost_table import CostTable
from tdpipe.runtime.profile_comm import measure_overheads, pipeline_overheads
from tdpipe.runtime.profile_plan import ProfilePlan as ProfilePlan  # re-exported: callers import the plan here
from tdpipe.runtime.profile_plan import max_decode_batch as max_decode_batch
from tdpipe.runtime.profile_plan import mean_decode_context as mean_decode_context
from tdpipe.runtime.profile_plan import plan_profile as plan_profile
from tdpipe.runtime.stage_split import pipeline_split


@dataclass
class StageProfile:
    """Measured forward times (ms, median of repeats) of one stage."""

    stage: int
    layer_range: tuple[int, int]
    """The layers the stage holds (both of its ranges under the phase split)."""
    decode_context: int
    """KV length (tokens per sequence) every decode measurement used."""
    decode_ms: dict[int, float] = field(default_factory=dict)
    """Decode step time by batch size (one new token per request)."""
    prefill_ms: dict[int, float] = field(default_factory=dict)
    """Prefill time by total prompt tokens (whole prompts of `prefill_prompt_len` tokens)."""
    handoff_ms: dict[int, float] = field(default_factory=dict)
    """Sending this stage's hidden states to the next, by tokens (empty on the last stage)."""
    dispatch_ms: dict[int, float] = field(default_factory=dict)
    """First stage only: the controller's round trip into it, by decode batch size (profile_comm)."""
    prefill_prompt_len: int = 0
    """Length of the whole prompts every prefill measurement used (0: not recorded)."""


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
    runner: ModelRunner, batch: ForwardBatch, hidden: torch.Tensor | None, repeats: int, layers: tuple[int, int]
) -> float:
    times = []
    on_gpu = runner.device.type == "cuda"
    for _ in range(repeats + 1):  # the first run warms caches and allocator; dropped
        if on_gpu:
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        out = runner.run(batch, hidden_states=hidden, layers=layers)
        if runner.is_last_stage:
            out = out.argmax(dim=-1)  # the stage worker samples greedily inside its span
        if on_gpu:  # kernels are asynchronous: the forward ends when the device says so
            torch.cuda.synchronize(runner.device)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times[1:])


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
) -> list[StageProfile]:
    """Time every stage's slice on decode batches and prefill batches (see the module docstring);
    with `phase_split`, each phase on its own split (`stage_split.pipeline_split`).

    One stage at a time in this process with `num_threads` torch threads, as a stage process runs
    (on `device`: CUDA timings synchronise the device; not exercised on a GPU here).
    `attention_backend` must be what the stages use ("auto", as `StageConfig` gives them) for a
    faithful table; tests pass "torch" to skip the C++ kernel's first-use build.
    """
    if not decode_batches or not prefill_tokens:
        raise ValueError("need at least one decode batch size and one prefill token count")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    need_blocks = max(
        max(decode_batches) * _blocks(decode_context, block_size),
        max(prefill_tokens) // block_size + max(prefill_tokens) // max(1, prefill_prompt_len) + 2,
    )
    previous_threads = torch.get_num_threads()
    profiles = []
    try:
        split = pipeline_split(cfg, num_stages, phase_split)
        for stage in range(num_stages):
            layer_range = split.held(stage)
            runner = ModelRunner(
                model_dir,
                dtype=dtype,
                device=device,
                block_size=block_size,
                num_kv_blocks=need_blocks,
                layer_range=layer_range,
                num_threads=num_threads,
                attention_backend=attention_backend,
            )
            runner.attention.wait_ready()  # a first-use kernel build is not a forward time
            prof = StageProfile(stage, layer_range, decode_context, prefill_prompt_len=prefill_prompt_len)

            def hidden(n: int, runner: ModelRunner = runner) -> torch.Tensor | None:  # this stage's runner
                if runner.is_first_stage:
                    return None
                return torch.randn(n, cfg.hidden_size, dtype=runner.dtype, device=runner.device) * 0.1

            decode_layers, prefill_layers = split.span(stage, True), split.span(stage, False)
            for b in sorted(set(decode_batches)):
                batch = decode_batch(b, decode_context, block_size, cfg.vocab_size)
                prof.decode_ms[b] = _time_ms(runner, batch, hidden(b), repeats, decode_layers)
            for n in sorted(set(prefill_tokens)):
                batch = prefill_batch(n, prefill_prompt_len, block_size, cfg.vocab_size)
                prof.prefill_ms[n] = _time_ms(runner, batch, hidden(n), repeats, prefill_layers)
            profiles.append(prof)
            stage_dtype = runner.dtype  # what the hand-offs carry
            del runner
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()  # the stages load right after: give their memory back
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


def bottleneck_curve(profiles: list[StageProfile], phase: str) -> dict[int, float]:
    """Per token count, the slowest stage's time (ms) for `phase` ("decode" or "prefill")."""
    curves = [p.decode_ms if phase == "decode" else p.prefill_ms for p in profiles]
    keys = set(curves[0])
    if any(set(c) != keys for c in curves):
        raise ValueError("every stage must be profiled at the same points")
    return {n: max(c[n] for c in curves) for n in sorted(keys)}


def _interp(curve: dict[int, float], n: int) -> float:
    """Linear interpolation of a profiled curve at `n` (clamped to its first/last point)."""
    keys = sorted(curve)
    if n <= keys[0]:
        return curve[keys[0]]
    for a, b in zip(keys, keys[1:]):
        if a <= n <= b:
            w = (n - a) / (b - a)
            return curve[a] * (1 - w) + curve[b] * w
    return curve[keys[-1]]


def build_cost_table(profiles: list[StageProfile], name: str = "profiled", decode_max: int | None = None) -> CostTable:
    """A CostTable whose `stage_ms(n, len(profiles))` is the bottleneck stage's measured time:
    the decode curve for n <= `decode_max` (default: the largest profiled decode batch; between
    profiled points it is interpolated), the prefill curve above it (module docstring).

    Prefill batches smaller than `decode_max` tokens are priced as decode steps, which on a
    CPU cost more per token (every sequence reads its KV): keep `decode_max` at the largest
    decode batch the policies actually form (see `tdpipe_runtime.py`)."""
    if not profiles:
        raise ValueError("no stage profiles")
    num_stages = len(profiles)
    decode, prefill = bottleneck_curve(profiles, "decode"), bottleneck_curve(profiles, "prefill")
    cut = max(decode) if decode_max is None else decode_max
    if cut < 1:
        raise ValueError(f"decode_max must be >= 1, got {decode_max}")
    rows: dict[int, float] = {n: t for n, t in decode.items() if n < cut}
    rows[cut] = _interp(decode, cut)
    rows.update({n: t for n, t in prefill.items() if n > cut})
    tokens = sorted(rows)
    times, running = [], 0.0
    for n in tokens:
        running = max(running, rows[n])  # a bigger batch never costs less (noise can say otherwise)
        times.append(running * num_stages)
    over = pipeline_overheads(
        [p.decode_ms for p in profiles],
        [p.prefill_ms for p in profiles],
        profiles[0].handoff_ms,
        profiles[0].dispatch_ms,
        cut,
    )
    return CostTable(name, tuple(tokens), tuple(times), over)


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
