"""`cpu_paged`: paged attention that reads the KV pool in place (C++ op, CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, layer_window
from pdserve.engine.attention.torch_backend import TorchAttention, causal_self_attention, chunk_attention
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kernels import cpu_build

CHUNK_SDPA_MIN_TOKENS = 16
"""A prefill chunk after a cached prefix this long or longer goes to SDPA over its gathered pages
(`chunk_attention`); shorter ones and decode tokens to the kernel. Measured, both dtypes: SDPA 2x
faster at 16 query tokens, 3-4x at 64-400 (the kernel runs an exact softmax per query token)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What the compiled CPU ops (attention and the fused elementwise ops) are written for."""
PROMPT_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Where the prompt kernel (`paged_prefill_attention`) replaces SDPA for the many-token sequences. In
float32 (AVX-512) it ran 1.3-1.6x faster than SDPA's flash kernel at 64-512 tokens (2-core Sapphire
Rapids). bfloat16 takes it only on AMX tiles (`prefill_amx_supported`: csrc/cpu_amx_prefill.cpp,
2.4-3.3x SDPA there); without AMX, SDPA was 2x faster than the AVX-512 kernel's float32 arithmetic,
so bf16 keeps SDPA, except in a layer with sinks, which SDPA cannot run (`_runs_prompts`)."""


class CpuPagedAttention(AttentionBackend):
    """Decode tokens and short prefix-cached chunks through one C++ call per layer over the pages in place.

    A prompt with no cached prefix attends only to its own fresh K/V, so it keeps
    SDPA's causal flash kernel (`causal_self_attention`, shared with the torch backend); a chunk of
    `CHUNK_SDPA_MIN_TOKENS` or more after a cached prefix gathers its pages for SDPA too
    (`chunk_attention`, also the torch backend's). In float32 on an AVX-512 CPU, and in bfloat16 on one
    with AMX tiles, both go instead to one call of the prompt kernel over their pages in place
    (`PROMPT_KERNEL_DTYPES`). A layer with attention sinks (gpt-oss) passes them to both kernels; the
    rows the prompt kernel does not take then go to the torch backend's `sink_attention` in place of
    SDPA, which has no sink term. Until the op
    is built (first use on a machine), or forever without a compiler, steps run the torch backend's
    path (see `cpu_build`); the choice is made per step. The compiled ops run float32 and bfloat16;
    a float16 model runs the torch path throughout (`configure`), so that it never switches to ops
    that reject it once they are built.
    """

    def __init__(self) -> None:
        cpu_build.start_build()
        self._kernel_dtype = True
        self._prompt_kernel: dict[tuple[int, torch.dtype, bool], bool] = {}  # whether the prompt kernel runs it
        self._op = cpu_build.current_op()
        self._fallback = TorchAttention()
        self._plan: _StepPlan | None = None

    def configure(self, num_qo_heads: int, dtype: torch.dtype, *, attention_sinks: bool = False) -> None:
        self._kernel_dtype = dtype in KERNEL_DTYPES
        self._op = self._op if self._kernel_dtype else None

    @property
    def uses_kernel(self) -> bool:
        return self._op is not None

    def wait_ready(self) -> None:
        self._op = cpu_build.load_paged_attention_op() if self._kernel_dtype else None

    def begin_step(self, meta: AttentionMetadata, kv_layer_shape: torch.Size) -> None:
        # picked once per step, so all layers of a step agree
        self._op = cpu_build.current_op() if self._kernel_dtype else None
        self._plan = _StepPlan.of(meta)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv: Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if self._op is None or q.device.type != "cpu":
            return self._fallback.forward(q, k, v, kv, meta, scale, window=window, sinks=sinks)
        # kv: [N, P, Hkv, B, D] (P = 1: an MLA latent, which the kernels read as K and V); write this
        # step's K/V into the pages first
        torch.ops.pdserve_cpu.store_kv(kv, k, v, meta.slot_blocks, meta.slot_offsets)
        if self._plan is None or self._plan.meta is not meta:
            self.begin_step(meta, kv.shape)
        plan = self._plan
        assert plan is not None
        window = layer_window(meta, window)
        decode = plan.decode
        # the kernels take the sinks (gpt-oss) as a last positional argument, None for none
        if decode.rows is None:  # decode-only or all short chunks: one call, no copies
            return self._op(q, kv, decode.table, decode.starts, decode.ctx, scale, window or 0, sinks)
        out = torch.empty_like(q)
        if decode.rows.numel():
            rows = decode.rows
            out[rows] = self._op(
                q.index_select(0, rows), kv, decode.table, decode.starts, decode.ctx, scale, window or 0, sinks
            )
        if q.dtype in PROMPT_KERNEL_DTYPES and self._runs_prompts(q.shape[-1], q.dtype, sinks is not None):
            p = plan.prompts()
            prompt_op = torch.ops.pdserve_cpu.paged_prefill_attention
            if p.rows is None:  # prompts only: one call, no copies
                return prompt_op(q, kv, p.table, p.starts, p.ctx, scale, window or 0, True, sinks)
            out[p.rows] = prompt_op(
                q.index_select(0, p.rows), kv, p.table, p.starts, p.ctx, scale, window or 0, True, sinks
            )
            return out
        b = meta.batch
        # SDPA has no sink term: with sinks these take the torch backend's `sink_attention` (same masks)
        for i, s, e in plan.sdpa:
            if b.query_lens[i] == b.context_lens[i]:  # fresh prompt: causal SDPA over its own K/V
                out[s:e] = causal_self_attention(q[s:e], k[s:e], v[s:e], scale, window, sinks)
            else:  # a long chunk after a cached prefix: SDPA over its gathered pages
                table, ctx = b.block_tables[i], b.context_lens[i]
                out[s:e] = chunk_attention(q[s:e], kv, table, ctx, meta.block_size, scale, window, sinks)
        return out

    def _runs_prompts(self, head_dim: int, dtype: torch.dtype, sinks: bool = False) -> bool:
        key = (head_dim, dtype, sinks)
        if key not in self._prompt_kernel:
            ops = torch.ops.pdserve_cpu
            runs = ops.prefill_supported(head_dim)
            if dtype == torch.bfloat16:
                # without sinks bf16 takes the kernel on AMX tiles only (`PROMPT_KERNEL_DTYPES`); with
                # them the alternative is `sink_attention`'s float32 matmuls, not SDPA, and the AVX-512
                # kernel ran 4-14x faster than that (bench gpt-oss's 12/4 heads of 64, 64-512-token
                # prompts, 2-core AVX-512 EPYC)
                runs = ops.prefill_amx_supported(head_dim) or (sinks and runs)
            self._prompt_kernel[key] = bool(runs)
        return self._prompt_kernel[key]


@dataclass
class _Group:
    """Sequences for one kernel call: their page tables, query offsets and context lengths."""

    table: Tensor
    """int32 [S, P] page tables (zero-padded)."""
    starts: Tensor
    """int32 [S + 1] offsets of their query tokens in the kernel's input."""
    ctx: Tensor
    """int32 [S] context lengths."""
    rows: Tensor | None
    """int64 rows of the step's q that are the kernel's input, in order; None when all of them are."""

    @classmethod
    def of(cls, b: ForwardBatch, seqs: list[int], rows: Tensor | None) -> _Group:
        starts, table_rows, ctx = [0], [], []
        width = max((len(b.block_tables[i]) for i in seqs), default=0)
        for i in seqs:
            starts.append(starts[-1] + b.query_lens[i])
            table_rows.append(b.block_tables[i] + [0] * (width - len(b.block_tables[i])))
            ctx.append(b.context_lens[i])
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        return cls(i32(table_rows).reshape(len(seqs), width), i32(starts), i32(ctx), rows)


@dataclass
class _StepPlan:
    """How one step's sequences split between the kernels and SDPA, built once and shared by every layer."""

    meta: AttentionMetadata
    decode: _Group
    """The sequences with cached context and few query tokens (decode tokens, short later chunks):
    the paged attention kernel's."""
    sdpa: list[tuple[int, int, int]]
    """(sequence, first row, end row) of the fresh prompts and long chunks: SDPA's, or the prompt kernel's."""
    _prompts: _Group | None = None

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _StepPlan:
        b = meta.batch
        paged: list[int] = []
        sdpa: list[tuple[int, int, int]] = []
        rows: list[int] = []
        offset = 0
        for i, (q_len, c) in enumerate(zip(b.query_lens, b.context_lens)):
            if q_len < c and q_len < CHUNK_SDPA_MIN_TOKENS:
                paged.append(i)
                rows.extend(range(offset, offset + q_len))
            else:
                sdpa.append((i, offset, offset + q_len))
            offset += q_len
        kernel_rows = None if not sdpa else torch.tensor(rows, dtype=torch.long)
        return cls(meta, _Group.of(b, paged, kernel_rows), sdpa)

    def prompts(self) -> _Group:
        """The `sdpa` sequences as one group for the prompt kernel (built on first use)."""
        if self._prompts is None:
            rows = [r for _, s, e in self.sdpa for r in range(s, e)]
            seqs = [i for i, _, _ in self.sdpa]
            every_row = len(seqs) == len(self.meta.batch.query_lens)
            self._prompts = _Group.of(
                self.meta.batch, seqs, None if every_row else torch.tensor(rows, dtype=torch.long)
            )
        return self._prompts
