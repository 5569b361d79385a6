"""`cpu_paged`: paged attention that reads the KV pool in place (C++ op, CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention import cpu_build
from engine.attention.torch_backend import TorchAttention, causal_self_attention, chunk_attention

CHUNK_SDPA_MIN_TOKENS = 16
"""A prefill chunk after a cached prefix this long or longer goes to SDPA over its gathered pages
(`chunk_attention`); shorter ones and decode tokens to the kernel. Measured, both dtypes: SDPA 2x
faster at 16 query tokens, 3-4x at 64-400 (the kernel runs an exact softmax per query token)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What the compiled CPU ops (attention and the fused elementwise ops) are written for."""


class CpuPagedAttention(AttentionBackend):
    """Decode tokens and short prefix-cached chunks through one C++ call per layer over the pages in place.

    A prompt with no cached prefix attends only to its own fresh K/V, so it keeps
    SDPA's causal flash kernel (`causal_self_attention`, shared with the torch backend); a chunk of
    `CHUNK_SDPA_MIN_TOKENS` or more after a cached prefix gathers its pages for SDPA too
    (`chunk_attention`, also the torch backend's). Until the op is built (first use on a machine),
    or forever without a compiler, steps run the torch backend's path (see `cpu_build`); the choice
    is made per step. The compiled ops run float32 and bfloat16; a float16 model runs the torch path
    throughout (`configure`), so that it never switches to ops that reject it once they are built.
    """

    def __init__(self) -> None:
        cpu_build.start_build()
        self._kernel_dtype = True
        self._op = cpu_build.current_op()
        self._fallback = TorchAttention()
        self._plan: _StepPlan | None = None

    def configure(self, num_qo_heads: int, dtype: torch.dtype) -> None:
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        if self._op is None or q.device.type != "cpu":
            return self._fallback.forward(q, k, v, kv, meta, scale)
        # kv: [N, 2, Hkv, B, D]; write this step's K/V into the pages first
        torch.ops.pdserve_cpu.store_kv(kv, k, v, meta.slot_blocks, meta.slot_offsets)
        if self._plan is None or self._plan.meta is not meta:
            self.begin_step(meta, kv.shape)
        plan = self._plan
        assert plan is not None
        window = meta.sliding_window
        if plan.kernel_rows is None:  # decode-only or all short chunks: one call, no copies
            return self._op(q, kv, plan.table, plan.starts, plan.ctx, scale, window or 0)
        out = torch.empty_like(q)
        if plan.kernel_rows.numel():
            rows = plan.kernel_rows
            out[rows] = self._op(q.index_select(0, rows), kv, plan.table, plan.starts, plan.ctx, scale, window or 0)
        b = meta.batch
        for i, s, e in plan.sdpa:
            if b.query_lens[i] == b.context_lens[i]:  # fresh prompt: causal SDPA over its own K/V
                out[s:e] = causal_self_attention(q[s:e], k[s:e], v[s:e], scale, window)
            else:  # a long chunk after a cached prefix: SDPA over its gathered pages
                table, ctx = b.block_tables[i], b.context_lens[i]
                out[s:e] = chunk_attention(q[s:e], kv, table, ctx, meta.block_size, scale, window)
        return out


@dataclass
class _StepPlan:
    """How one step's sequences split between the kernel and SDPA, built once and shared by every layer."""

    meta: AttentionMetadata
    table: Tensor
    """int32 [S, P] page tables of the kernel's sequences (zero-padded)."""
    starts: Tensor
    """int32 [S + 1] offsets of their query tokens in the kernel's input."""
    ctx: Tensor
    """int32 [S] their context lengths."""
    kernel_rows: Tensor | None
    """Rows of q that go to the kernel; None when all of them do."""
    sdpa: list[tuple[int, int, int]]
    """(sequence, first row, end row) of the fresh prompts and long chunks, which go to SDPA."""

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _StepPlan:
        b = meta.batch
        # only the sequences with cached context and few query tokens (decode tokens, short later
        # chunks) go to the kernel
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
        starts, table_rows, ctx = [0], [], []
        width = max((len(b.block_tables[i]) for i in paged), default=0)
        for i in paged:
            starts.append(starts[-1] + b.query_lens[i])
            table_rows.append(b.block_tables[i] + [0] * (width - len(b.block_tables[i])))
            ctx.append(b.context_lens[i])
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        kernel_rows = None if not sdpa else torch.tensor(rows, dtype=torch.long)
        return cls(meta, i32(table_rows).reshape(len(paged), width), i32(starts), i32(ctx), kernel_rows, sdpa)
