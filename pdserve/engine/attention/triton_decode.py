"""Paged decode attention as one Triton kernel: the CUDA decode path of the torch backend, and the
attention the decode CUDA graphs capture (engine.cuda_graphs).

Why a kernel of our own: the torch backend's decode gathers every sequence's pages into a padded
[S, Hkv, P*B, D] copy and sizes it from the longest context, a host read (`int(ctx.max())`) that
no CUDA graph can hold. This kernel reads each sequence's pages in place through its block table,
runs to that sequence's own context length (read on the device), and takes a fixed-width table:
the same launch serves every step of a captured batch size.

One program per (sequence, KV head, split) computes all the query heads of that KV head's group
(GQA) with an online softmax over tiles of BLOCK_N keys of its share of the context; with more than
one split (small batches: flash-decoding) a second kernel merges the shares; a sliding window starts the loop at the
window's first key; gpt-oss's sinks join the softmax denominator at the end. It runs under
Triton's interpreter on CPU (TRITON_INTERPRET=1, tests/engine/test_triton_decode.py) and on CUDA in
`pytest -m gpu` against the gather + SDPA reference.
"""

from __future__ import annotations

import functools

import torch

BLOCK_N = 64
"""Keys per tile (a multiple of every block size the pool takes up to 64; smaller pages are read
several to a tile through the block table)."""
NUM_WARPS = 4
"""Warps of one program (Triton's default)."""
MIN_DOT = 16
"""tl.dot's smallest M/N/K: the query-head group and the head size are padded up to it."""


@functools.cache
def available() -> bool:
    """Whether Triton imports (the CUDA image has it; the [gpu] extra pulls it in with torch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _kernel():  # the jit function is built on first use so that importing this module needs no triton
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        table_ptr,
        ctx_ptr,
        sinks_ptr,
        stride_qs,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_kb,
        stride_vn,
        stride_vh,
        stride_vb,
        stride_os,
        stride_oh,
        stride_ts,
        ws_acc_ptr,
        ws_ml_ptr,
        scale,
        window,
        NSPLIT: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        TILE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + s)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(
            q_ptr + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # with a window the query (at ctx - 1) sees keys ctx - window .. ctx - 1
        first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        # this program's share of the tiles (flash-decoding): NSPLIT programs per (sequence, head)
        first_tile = (first // TILE) * TILE
        per_split = tl.cdiv(tl.cdiv(ctx - first_tile, TILE), NSPLIT) * TILE
        lo = first_tile + split * per_split
        hi = tl.minimum(lo + per_split, ctx)
        for start in range(lo, hi, TILE):
            offs_n = start + tl.arange(0, TILE)
            n_mask = (offs_n < ctx) & (offs_n >= first)
            block = tl.load(table_ptr + s * stride_ts + offs_n // PAGE, mask=n_mask, other=0)
            slot = offs_n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + block[:, None] * stride_kn + kvh * stride_kh + slot[:, None] * stride_kb + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + block[:, None] * stride_vn + kvh * stride_vh + slot[:, None] * stride_vb + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row_mask = g_mask[:, None] & d_mask[None, :]
        if NSPLIT > 1:  # partials for the reducer: unnormalized acc, running max and sum per head
            part = (s * (tl.num_programs(1) * GROUP) + heads) * NSPLIT + split  # [S, Hq, NSPLIT]
            tl.store(ws_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)
            tl.store(ws_ml_ptr + part * 2, m_i, mask=g_mask)
            tl.store(ws_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
        else:
            if HAS_SINKS:  # one more logit per head in the denominator, with no value
                sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
                m_fin = tl.maximum(m_i, sink)
                rescale = tl.exp(m_i - m_fin)
                acc = acc * rescale[:, None]
                l_i = l_i * rescale + tl.exp(sink - m_fin)
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + s * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_mask,
            )

    @triton.jit
    def reduce_splits_kernel(
        ws_acc_ptr,
        ws_ml_ptr,
        out_ptr,
        sinks_ptr,
        stride_os,
        stride_oh,
        NSPLIT: tl.constexpr,
        NSPLIT_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        s = tl.program_id(0)
        h = tl.program_id(1)
        offs_j = tl.arange(0, NSPLIT_PAD)
        offs_d = tl.arange(0, D_PAD)
        j_mask = offs_j < NSPLIT
        d_mask = offs_d < HEAD_DIM
        part = (s * tl.num_programs(1) + h) * NSPLIT + offs_j
        m = tl.load(ws_ml_ptr + part * 2, mask=j_mask, other=float("-inf"))
        l_j = tl.load(ws_ml_ptr + part * 2 + 1, mask=j_mask, other=0.0)
        acc = tl.load(
            ws_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=j_mask[:, None] & d_mask[None, :], other=0.0
        )
        m_max = tl.max(m, 0)
        w = tl.exp(m - m_max)  # an empty split (m = -inf) weighs 0
        total = tl.sum(l_j * w, 0)
        o = tl.sum(acc * w[:, None], 0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h).to(tl.float32)
            m_fin = tl.maximum(m_max, sink)
            rescale = tl.exp(m_max - m_fin)
            o = o * rescale
            total = total * rescale + tl.exp(sink - m_fin)
        tl.store(
            out_ptr + s * stride_os + h * stride_oh + offs_d, (o / total).to(out_ptr.dtype.element_ty), mask=d_mask
        )

    return paged_decode_kernel, reduce_splits_kernel


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The least power of two >= n and >= floor (a tile's padded extent: Triton's ranges are powers
    of two)."""
    p = floor
    while p < n:
        p *= 2
    return p


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    tile: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    splits: int | None = None,
) -> torch.Tensor:
    """q [S, Hq, D] (one query per sequence), k/v pages [N, Hkv, B, D] (the pool layer's planes, any
    strides with D contiguous), table int32 [S, P] (sequence s's block ids; entries past its context
    are never read), ctx_lens int32 [S] (each >= 1) -> [S, Hq, D] in q's dtype. `window`: attend
    within the last W keys (None: all); `sinks` float [Hq] (gpt-oss). `tile` and `num_warps`: the
    launch's shape (benchmarks/gpu_decode.py times the choices). `splits`: programs per (sequence,
    KV head), each over a share of the keys, merged by a second kernel (None: `split_count`; a
    small batch would otherwise leave most of the device idle)."""
    s, hq, d = q.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if tile % page and page % tile:
        raise ValueError(f"block size {page} does not tile into {tile}-key tiles")
    for name, t in (("q", q), ("k pages", k_pages), ("v pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in the head dimension")
    if out is None:
        out = torch.empty_like(q)
    group = hq // hkv
    tile = max(tile, page)
    if splits is None:
        splits = split_count(s * hkv, table.shape[1] * page, tile, q.device)
    d_pad = pow2_at_least(d, MIN_DOT)
    ws_acc = ws_ml = q  # never written with one split
    if splits > 1:
        ws_acc = torch.empty(s, hq, splits, d, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(s, hq, splits, 2, dtype=torch.float32, device=q.device)
    sink_arg = sinks if sinks is not None else q  # never read without HAS_SINKS
    decode, reduce = _kernel()
    decode[(s, hkv, splits)](
        q,
        k_pages,
        v_pages,
        out,
        table,
        ctx_lens,
        sink_arg,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        out.stride(0),
        out.stride(1),
        table.stride(0),
        ws_acc,
        ws_ml,
        scale,
        window or 0,
        NSPLIT=splits,
        GROUP=group,
        GROUP_PAD=pow2_at_least(group, MIN_DOT),
        HEAD_DIM=d,
        D_PAD=d_pad,
        PAGE=page,
        TILE=tile,
        HAS_SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    if splits > 1:
        reduce[(s, hq)](
            ws_acc,
            ws_ml,
            out,
            sink_arg,
            out.stride(0),
            out.stride(1),
            NSPLIT=splits,
            NSPLIT_PAD=pow2_at_least(splits, 2),
            HEAD_DIM=d,
            D_PAD=d_pad,
            HAS_SINKS=sinks is not None,
            num_warps=1,
        )
    return out


MAX_SPLITS = 32
"""Most programs one (sequence, KV head) is split over."""


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy: two per multiprocessor (one on the interpreter)."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_count(pairs: int, max_keys: int, tile: int, device: torch.device) -> int:
    """Programs per (sequence, KV head): enough that `pairs` of them fill the device, never more
    than the longest context (`max_keys`, the table's width) has tiles. Fixed by the batch size and
    the table's width alone, so a CUDA graph of one batch size replays one launch shape."""
    if pairs >= _programs_wanted(device):
        return 1
    wanted = -(-_programs_wanted(device) // pairs)
    return max(1, min(MAX_SPLITS, wanted, -(-max_keys // tile)))
