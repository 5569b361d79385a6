"""Reference attention on plain torch ops: runs on CPU and any device."""

from __future__ import annotations

import torch
from torch import Tensor
import torch.nn.functional as F

from pdserve.engine.attention import triton_decode
from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, kv_pages, layer_window, store_kv
from pdserve.engine.block_manager import blocks_for
from pdserve.engine.forward_batch import ForwardBatch


class TorchAttention(AttentionBackend):
    """Scatter new K/V into the pool, then scaled_dot_product_attention per step.

    Decode-only steps are one batched SDPA call over the gathered, length-masked
    pages (on CUDA, where Triton imports, one paged kernel reading the pages in place instead:
    `triton_decode`); prefill sequences are handled one at a time (a prompt with no cached
    prefix attends causally over its own fresh K/V without touching the pool). A sliding window
    (`meta.sliding_window`, or the layer's own `window`) narrows every mask to the last W keys of
    each query. A layer with sinks (gpt-oss) takes `sink_attention` in place of SDPA, same masks.
    """

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
        store_kv(kv, k, v, meta)
        # kv: [N, P, Hkv, B, D]; k_pages/v_pages: [N, Hkv, B, D] views (one object when P = 1: MLA)
        k_pages, v_pages = kv_pages(kv)
        batch = meta.batch
        window = layer_window(meta, window)
        if batch.is_decode_only:
            return self._decode(q, k_pages, v_pages, meta, scale, window, sinks)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            end = start + q_len
            if q_len == ctx:  # whole sequence is new: plain causal attention on fresh K/V
                out[start:end] = causal_self_attention(q[start:end], k[start:end], v[start:end], scale, window, sinks)
            else:
                table = batch.block_tables[i]
                out[start:end] = chunk_attention(q[start:end], kv, table, ctx, meta.block_size, scale, window, sinks)
            start = end
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        sinks: Tensor | None = None,
    ) -> torch.Tensor:
        batch, bs = meta.batch, meta.block_size
        table, ctx = meta.decode_table, meta.decode_ctx
        if q.is_cuda and v_pages is not k_pages and triton_decode.available():
            if table is None or ctx is None:  # an eager step: its tables from the batch's lists, once per step
                table, ctx = meta.decode_table, meta.decode_ctx = decode_tables(batch, bs, q.device)
            return triton_decode.paged_decode(q, k_pages, v_pages, table, ctx, scale, window, sinks)
        if table is not None and ctx is not None:  # a graph's fixed-width tables, without the kernel
            max_pages, ctx = table.shape[1], ctx.long()
            table = table.long()
        else:
            ctx = torch.tensor(batch.context_lens, device=q.device)
            max_pages = (int(ctx.max()) + bs - 1) // bs
            table = torch.zeros((batch.num_seqs, max_pages), dtype=torch.long, device=q.device)
            for i, row in enumerate(batch.block_tables):
                n = min(len(row), max_pages)
                table[i, :n] = torch.tensor(row[:n], dtype=torch.long)
        s, hkv, d = q.shape[0], k_pages.shape[1], k_pages.shape[-1]
        # [S, P, Hkv, B, D] -> [S, Hkv, P*B, D]
        keys = k_pages[table].permute(0, 2, 1, 3, 4).reshape(s, hkv, max_pages * bs, d)
        values = keys  # one-plane (MLA) pages: the latent is the value too
        if v_pages is not k_pages:
            values = v_pages[table].permute(0, 2, 1, 3, 4).reshape(s, hkv, max_pages * bs, d)
        keys_pos = torch.arange(max_pages * bs, device=q.device)[None, :]
        valid = keys_pos < ctx[:, None]  # [S, P*B]
        if window is not None:  # the query sits at ctx - 1 and sees keys > ctx - 1 - W
            valid &= keys_pos >= ctx[:, None] - window
        if sinks is not None:
            return sink_attention(q[:, :, None, :], keys, values, valid[:, None, :], sinks, scale)[:, :, 0, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out[:, :, 0, :]


def decode_tables(batch: ForwardBatch, block_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """A decode step's block tables (int32 [S, P], P the longest context's pages, rows zero-padded)
    and context lengths (int32 [S]) on `device`: what `triton_decode.paged_decode` reads."""
    widths = [blocks_for(c, block_size) for c in batch.context_lens]
    width = max(widths)
    rows = [row[:n] + [0] * (width - n) for row, n in zip(batch.block_tables, widths)]
    table = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
    return table, torch.tensor(batch.context_lens, dtype=torch.int32).to(device, non_blocking=True)


def window_mask(first_pos: int, num_queries: int, num_keys: int, window: int | None, device: torch.device) -> Tensor:
    """[L, K] bool: query j (at position first_pos + j) sees key p when p <= its position and, with a
    window W, p > its position - W (Hugging Face's sliding-window mask)."""
    rows = torch.arange(first_pos, first_pos + num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def causal_self_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """Causal self-attention of one fresh prompt: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    The tensors go in with a batch dimension of 1: on CPU only 4-D inputs reach SDPA's flash kernel
    (3-D ones take the math path, measured 3-4x slower at 256-512 tokens), which is also the kernel
    transformers' sdpa attention runs. A prompt longer than a sliding window takes the window's mask.
    With `sinks` [Hq], `sink_attention` instead."""
    t = q.shape[0]
    if sinks is not None:
        q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
        return sink_attention(q4, k4, v4, window_mask(0, t, t, window, q.device)[None], sinks, scale)[0].transpose(0, 1)
    mask = window_mask(0, t, t, window, q.device) if window is not None and t > window else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def chunk_attention(
    q: Tensor,
    kv: Tensor,
    table: list[int],
    ctx: int,
    block_size: int,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """A prefill chunk after a cached prefix: q [L, Hq, D] holds the queries of positions ctx - L ..
    ctx - 1; their keys and values (the first `ctx` of the sequence, this chunk's included) are
    gathered from the pool layer kv [N, P, Hkv, B, D] and attended with a causal (and sliding
    window) mask. 4-D inputs,
    so that on CPU SDPA runs its flash kernel (2-4x faster than the math path, or than the
    cpu_paged kernel's per-query softmax, for chunks of 16-400 tokens)."""
    q_len = q.shape[0]
    ki, vi = _gather(*kv_pages(kv), table, ctx, block_size)
    # query row j sits at position ctx - q_len + j and sees keys 0..that position (the last W with a window)
    mask = window_mask(ctx - q_len, q_len, ctx, window, q.device)
    if sinks is not None:
        return sink_attention(q.transpose(0, 1)[None], ki[None], vi[None], mask[None], sinks, scale)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], ki[None], vi[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


SINK_SCORES_BUDGET = 1 << 24
"""Float32 scores `sink_attention` holds at once (64 MiB): queries go through in chunks of this many
scores, so a long prompt never materializes its whole [Hq, L, K] score matrix."""


def sink_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """Attention with gpt-oss's sinks: q [B, Hq, L, D], k/v [B, Hkv, K, D], mask bool [B or 1, L, K]
    (True: attend), sinks [Hq] -> [B, Hq, L, D] in q's dtype.

    SDPA has no term for a logit that joins the softmax denominator without a value, so the softmax
    is computed here, in float32, as transformers' eager attention does: scores, the masked ones
    -inf, the head's sink appended as one more column, softmax, the sink column dropped. Query head
    h reads KV head h // (Hq / Hkv) (a broadcast, no copy of K/V). Each chunk of queries scores only
    the key columns its mask opens (a window's last W keys, a causal prefix)."""
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    q5 = q.float().view(b, hkv, group, length, d)
    k5, v5 = k.float()[:, :, None], v.float()[:, :, None]  # [B, Hkv, 1, K, D]
    sink = sinks.float().view(1, hkv, group, 1, 1)
    out = torch.empty(b, hkv, group, length, v.shape[-1], dtype=q.dtype, device=q.device)
    rows = max(1, SINK_SCORES_BUDGET // max(1, b * hq * k.shape[2]))
    for s in range(0, length, rows):
        e = min(s + rows, length)
        m = mask[:, s:e]
        cols = m.any(dim=0).any(dim=0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)
        scores = torch.matmul(q5[:, :, :, s:e], k5[:, :, :, lo:hi].transpose(-1, -2)) * scale
        scores = scores.masked_fill(~m[:, None, None, :, lo:hi], float("-inf"))
        logits = torch.cat([scores, sink.expand(b, hkv, group, e - s, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[:, :, :, s:e] = torch.matmul(probs, v5[:, :, :, lo:hi]).to(q.dtype)
    return out.view(b, hq, length, -1)


def _gather(
    k_pages: torch.Tensor, v_pages: torch.Tensor, table: list[int], ctx: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `ctx` cached K/V as [Hkv, ctx, D] each (one tensor twice when the pages are
    one object: an MLA latent is both)."""
    n = blocks_for(ctx, block_size)
    idx = torch.tensor(table[:n], dtype=torch.long, device=k_pages.device)
    hkv, d = k_pages.shape[1], k_pages.shape[-1]
    ki = k_pages[idx].permute(1, 0, 2, 3).reshape(hkv, n * block_size, d)[:, :ctx]
    if v_pages is k_pages:
        return ki, ki
    vi = v_pages[idx].permute(1, 0, 2, 3).reshape(hkv, n * block_size, d)[:, :ctx]
    return ki, vi
