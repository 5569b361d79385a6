"""Which decoder layers each pipeline stage holds: a contiguous split weighted by the LM head.

The last stage also runs the final norm and the LM head (hidden x vocab per token); on the `bench`
model that is about 4.2 decoder layers' worth, so an equal split of the layers leaves the other
stages idle a large share of every decode step. The split here prices every decoder layer at 1
and the last stage's head at `lm_head_layers(cfg)`, and gives the contiguous split whose most
expensive stage is cheapest.

Every process that must agree on the split (the controller sizing KV, the profile pass, each
`pdserve stage`) calls `model_stage_ranges` on the same `config.json` and stage count, so they
agree without exchanging the ranges. The cost depends on nothing else (not on the device, dtype
or tensor-parallel size): a stage started with other flags still computes its neighbours' split.

That split is the decode split. A prefill runs the head on one token per prompt, so on the
same split the earlier stages do most of a prefill's work (bench, 2 stages: layers 0-7 against
8-11, 2:1). With the phase split (`PipelineSplit`, `pdserve batch --phase-split`) prefill batches
run on the equal split instead, and each stage holds the layers of both of its ranges. A layer
that two neighbours run (bench: 6 and 7) has its KV in memory both map (`shared_kv`): whichever
stage runs it for a batch writes its KV there, and the other reads it in a later batch. That is
safe because a sequence's batches never overlap in the pipeline: a decode step starts after the
token of the batch before it was sampled, and the chunks of one prompt all run on the prefill
split, in order, on each stage (TD-Pipe has a prompt's chunks in flight together; a piece of a
split prompt is never under `td_scheduler.MIN_CHUNK` tokens, so its batch is never decode-only).
Local CPU stages only (one host's memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.model_config import ModelConfig


def decoder_layer_weights(cfg: ModelConfig) -> int:
    """Matmul weights one token goes through in one decoder layer: q/k/v/o (GQA: k and v are
    kv_heads x head_dim wide) and the gated MLP's gate/up/down (of a mixture-of-experts model: its
    router and top-k experts, averaged over sparse and dense layers). Norms, RoPE and biases are
    elementwise and left out; attention over the KV grows with the context and is left out too."""
    attention = attention_weights(cfg)
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    if cfg.moe is None:
        return attention + dense
    sparse = cfg.hidden_size * (cfg.moe.num_experts + 3 * cfg.moe.top_k * cfg.moe.intermediate_size)
    layers = cfg.num_hidden_layers
    n_sparse = sum(cfg.is_sparse(i) for i in range(layers))
    return attention + (n_sparse * sparse + (layers - n_sparse) * dense) // layers


def attention_weights(cfg: ModelConfig) -> int:
    """The attention projections' weights of one layer. For MLA, `head_dim` is the cached latent's
    width, not the heads': its projections are q (maybe through a low-rank q_a/q_b), the latent's
    kv_a, the heads' kv_b and o."""
    hidden, heads, mla = cfg.hidden_size, cfg.num_attention_heads, cfg.mla
    if mla is None:
        q_width = heads * cfg.head_dim
        kv_width = cfg.num_key_value_heads * cfg.head_dim
        return 2 * hidden * q_width + 2 * hidden * kv_width  # q, o; k, v
    q_width = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    q = hidden * q_width if mla.q_lora_rank is None else mla.q_lora_rank * (hidden + q_width)
    kv = hidden * mla.latent_dim + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * hidden


OP_OVERHEAD_WEIGHTS = 80_000
"""The fixed cost of launching one op, in matmul weights' worth. Fitted to the 128-wide `tiny`
model on one CPU thread (2026-11-26: a decode step's layer 0.54 ms, its head 0.25 ms; about
47 us per op at 0.6 ns per weight). Negligible for real models (a 4096-wide layer has 200M
weights), decisive for tiny ones, whose head is priced as 1.3 layers by weights alone but
measures under half of one."""
LAYER_OPS = 9
"""Ops of a decoder layer: norm, QKV GEMM, rotary + KV store, attention, O GEMM, add + norm,
gate/up GEMM, SiLU-mul, down GEMM."""
HEAD_OPS = 2
"""Ops of the head: the final norm and the LM-head GEMM."""


def lm_head_layers(cfg: ModelConfig) -> float:
    """The LM head's cost in decoder-layer equivalents (bench: 24.7M / 5.8M = 4.2; tiny: 0.46).

    Each side is its matmul weights plus a fixed cost per op (`OP_OVERHEAD_WEIGHTS`). A tied head
    is the same matmul as an untied one. The embedding is a row lookup on the first stage, not a
    matmul, and costs nothing here. On a decode step every sequence's one token goes through the
    head as through a layer; a prefill runs the head on one token per prompt only (the split is
    tuned for decode, which dominates a TD-Pipe job's stage time)."""
    head = cfg.hidden_size * cfg.vocab_size + HEAD_OPS * OP_OVERHEAD_WEIGHTS
    return head / (decoder_layer_weights(cfg) + LAYER_OPS * OP_OVERHEAD_WEIGHTS)


def _balanced(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts of an equal split, the earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]


def stage_layer_ranges(num_layers: int, num_stages: int, last_stage_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per stage, each holding at least one layer.

    A layer costs 1 and the last stage pays `last_stage_extra` more (its LM head: `lm_head_layers`).
    The split minimises the most expensive stage; among splits with the same maximum it takes the
    most balanced one (the stage costs sorted high to low, compared in order), and then the one
    whose earlier stages hold more layers. With `last_stage_extra` 0 this is the equal split with
    the remainder on the earlier stages.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the model must have at least one layer, got {num_layers!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 0 < num_stages <= num_layers:
        raise ValueError(f"stages must be in [1, {num_layers}] for a {num_layers}-layer model, got {num_stages!r}")
    if not isinstance(last_stage_extra, (int, float)) or not math.isfinite(last_stage_extra) or last_stage_extra < 0:
        raise ValueError(f"the last stage's extra cost must be a finite number >= 0, got {last_stage_extra!r}")
    if num_stages == 1:
        return [(0, num_layers)]
    best: tuple[list[float], int] | None = None
    counts: list[int] = []
    # the other stages are best split equally, so only the last stage's layer count is searched
    for last in range(1, num_layers - num_stages + 2):
        candidate = _balanced(num_layers - last, num_stages - 1) + [last]
        costs = [float(n) for n in candidate]
        costs[-1] += last_stage_extra
        key = (sorted(costs, reverse=True), last)  # a smaller last stage leaves more on the earlier ones
        if best is None or key < best:
            best, counts = key, candidate
    ends = [sum(counts[: k + 1]) for k in range(num_stages)]
    return [(end - n, end) for n, end in zip(counts, ends)]


def stage_layer_range(num_layers: int, num_stages: int, stage: int, last_stage_extra: float = 0.0) -> tuple[int, int]:
    """Stage `stage`'s (0-based) range of `stage_layer_ranges`."""
    ranges = stage_layer_ranges(num_layers, num_stages, last_stage_extra)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages - 1}] for {num_stages} stages, got {stage!r}")
    return ranges[stage]


def model_stage_ranges(cfg: ModelConfig, num_stages: int) -> list[tuple[int, int]]:
    """The split every process of a pipeline over this checkpoint uses (module docstring)."""
    return stage_layer_ranges(cfg.num_hidden_layers, num_stages, lm_head_layers(cfg))


@dataclass(frozen=True)
class PipelineSplit:
    """Each stage's layer range for decode-only batches and for batches with prompt tokens."""

    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.decode)

    @property
    def by_phase(self) -> bool:
        """Whether some stage runs other layers for a prefill than for a decode step."""
        return self.decode != self.prefill

    def held(self, stage: int) -> tuple[int, int]:
        """The layers stage `stage` loads: the span of both its ranges (contiguous)."""
        (d0, d1), (p0, p1) = self.decode[stage], self.prefill[stage]
        return min(d0, p0), max(d1, p1)

    def span(self, stage: int, decode_only: bool) -> tuple[int, int]:
        """The layers stage `stage` runs for a batch: decode-only batches on the decode split, any
        batch with prompt tokens (a mixed batch of PP+HB too) on the prefill split."""
        return self.decode[stage] if decode_only else self.prefill[stage]


def pipeline_split(cfg: ModelConfig, num_stages: int, by_phase: bool = False) -> PipelineSplit:
    """`model_stage_ranges` for decode; with `by_phase`, the equal split (the head priced at
    nothing: one token per prompt) for prefill, else the same ranges."""
    decode = tuple(model_stage_ranges(cfg, num_stages))
    prefill = tuple(stage_layer_ranges(cfg.num_hidden_layers, num_stages)) if by_phase else decode
    return PipelineSplit(decode, prefill)


def resolve_phase_split(choice: str, device: str, tensor_parallel_size: int, external: bool) -> bool:
    """`--phase-split auto|on|off` for a job: auto is on where it can run (local CPU stages of one
    rank each, on an OS with `shared_kv`); `on` elsewhere is a ValueError saying why."""
    from pdserve.tdpipe.runtime import shared_kv

    why = None
    if external:
        why = "stages started elsewhere (--external-stages) cannot share KV memory"
    elif device != "cpu":
        why = f"it shares KV in host memory; the stages run on {device}"
    elif tensor_parallel_size != 1:
        why = "a tensor-parallel stage runs its whole layer range"
    elif not shared_kv.available():
        why = "this OS has no memfd_create"
    if choice == "on" and why:
        raise ValueError(f"--phase-split on: {why}")
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--phase-split must be auto, on or off, got {choice!r}")
    return choice != "off" and why is None
