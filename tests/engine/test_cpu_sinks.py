"""Attention sinks (gpt-oss) in the compiled CPU kernels: a logit per query head that joins each
query's softmax denominator and nothing else. The decode kernel (every variant this CPU runs) and the
prompt kernels (AVX-512, and AMX where this CPU has it) against the float64 reference with a sink
column, in float32 and bfloat16, with and without a window, GQA groups 1, 2 and 8, on two-plane and
one-plane (MLA) pools; sinks of every size: ordinary, above every score, beyond float32's exp range,
very negative. Then the cpu_paged backend: a step with sinks runs the kernels, not the torch path."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import make_backend, torch_backend
from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.forward_batch import ForwardBatch
from tests.engine.paged_reference import BF16_ATOL, index_tensors, op, place, reference
from tests.engine.test_cpu_paged_attention import kernels

__all__ = ["op", "kernels"]  # the fixtures

DTYPES = [torch.float32, torch.bfloat16]
SINK_KINDS = ["random", "above", "huge", "very_negative"]
"""random: N(0, 2), about the size of the scores; above: 2 over every score the head could have;
huge: 200, whose exp overflows float32 unless the max includes the sink; very_negative: -1e4, a sink
that adds nothing (the plain softmax)."""


def _atol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else BF16_ATOL


def _sinks(kind: str, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [Hq] sinks of `kind` for queries q [T, Hq, D] over the K rows of pool kv."""
    hq, hkv, d = q.shape[1], kv.shape[2], q.shape[2]
    if kind == "random":
        return torch.randn(hq, generator=torch.Generator().manual_seed(hq)) * 2
    if kind == "huge":
        return torch.full((hq,), 200.0)
    if kind == "very_negative":
        return torch.full((hq,), -1e4)
    # every pairing of the head's query rows with every K row of its kv head bounds its visible scores
    keys = kv[:, 0].double().transpose(0, 1).reshape(hkv, -1, d)
    qh = q.double().view(q.shape[0], hkv, hq // hkv, d)
    scores = torch.einsum("tkgd,knd->kgtn", qh, keys) * scale
    return (scores.flatten(2).amax(-1).flatten() + 2).float()


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, kind: str, what: str) -> None:
    assert got.dtype == dtype and torch.isfinite(got).all(), what
    torch.testing.assert_close(got.double(), want, atol=_atol(dtype), rtol=0, msg=f"{what}, {kind} sinks")


def _decode_batch(rng: random.Random, num_blocks: int, block_size: int):
    """Decode tokens and short chunks after cached context, contexts on and off page ends."""
    free = list(range(num_blocks))
    rng.shuffle(free)

    def draw() -> tuple[int, int]:
        ctx = rng.choice([1, 8, 9, 16, rng.randrange(1, 90)])
        return rng.choice([1, 1, min(ctx, rng.randrange(1, 9))]), ctx

    return place(rng, free, block_size, 7, draw)


def _prompt_batch(rng: random.Random, num_blocks: int, block_size: int):
    """Fresh prompts and long chunks after a cached prefix."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    return place(rng, free, block_size, 3, lambda: rng.choice([(40, 40), (20, 70), (16, 16), (33, 50)]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("window", [0, 7])
def test_decode_kernel_with_sinks_matches_the_reference(op, kernels, dtype, group, window):
    """Head size 64 holds its accumulators in registers (and takes vdpbf16ps in the dot kernel); 40
    is the general path."""
    rng = random.Random(10 * group + window)
    hkv, block_size = 2, 8
    for d in (64, 40):
        kv = torch.randn(40, 2, hkv, block_size, d, generator=torch.Generator().manual_seed(d)).to(dtype)
        tables, q_lens, ctxs = _decode_batch(rng, 40, block_size)
        table, starts = index_tensors(tables, q_lens)
        q = torch.randn(sum(q_lens), hkv * group, d, generator=torch.Generator().manual_seed(group)).to(dtype)
        ctx = torch.tensor(ctxs, dtype=torch.int32)
        for kind in SINK_KINDS:
            sinks = _sinks(kind, q, kv, d**-0.5).to(dtype)  # a bf16 model's own copy is widened by the op
            got = op(q, kv, table, starts, ctx, d**-0.5, window, sinks)
            want = reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window, sinks)
            _check(got, want, dtype, kind, f"d {d}")


PROMPT_KERNELS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
"""(dtype, amx): float32 and bf16 on the AVX-512 kernel, bf16 on AMX tiles where this CPU has them."""


def _prompt_kernel_or_skip(dtype: torch.dtype, amx: bool, d: int) -> None:
    if not torch.ops.pdserve_cpu.prefill_supported(d):
        pytest.skip("the prompt kernels need AVX-512")
    if amx and not torch.ops.pdserve_cpu.prefill_amx_supported(d):
        pytest.skip("this CPU has no AMX tiles")


@pytest.mark.parametrize("dtype, amx", PROMPT_KERNELS)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("window", [0, 7])
def test_prompt_kernel_with_sinks_matches_the_reference(op, dtype, amx, group, window):
    """Head size 64 has its own specialisation in both kernels; 96 (AMX) and 48 (AVX-512: not a
    multiple of 32) the others."""
    rng = random.Random(100 + 10 * group + window)
    hkv, block_size = 2, 8
    for d in (64, 96 if amx else 48):
        _prompt_kernel_or_skip(dtype, amx, d)
        kv = torch.randn(48, 2, hkv, block_size, d, generator=torch.Generator().manual_seed(d)).to(dtype)
        tables, q_lens, ctxs = _prompt_batch(rng, 48, block_size)
        table, starts = index_tensors(tables, q_lens)
        q = torch.randn(sum(q_lens), hkv * group, d, generator=torch.Generator().manual_seed(group)).to(dtype)
        ctx = torch.tensor(ctxs, dtype=torch.int32)
        for kind in SINK_KINDS:
            sinks = _sinks(kind, q, kv, d**-0.5)
            got = torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, table, starts, ctx, d**-0.5, window, amx, sinks)
            want = reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window, sinks)
            _check(got, want, dtype, kind, f"d {d}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_plane_pools_take_sinks(op, kernels, dtype):
    """kv [N, 1, 1, B, D] (MLA): the latent rows are the keys and the values; 8 query heads read them
    through both kernels with sinks."""
    rng = random.Random(5)
    block_size, hq = 16, 8
    for d in (48, 64):
        pool = torch.randn(24, 1, 1, block_size, d, generator=torch.Generator().manual_seed(d)).to(dtype)
        for batch, prompt in ((_decode_batch, False), (_prompt_batch, True)):
            tables, q_lens, ctxs = batch(rng, 24, block_size)
            table, starts = index_tensors(tables, q_lens)
            q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
            ctx = torch.tensor(ctxs, dtype=torch.int32)
            for kind in ("random", "above"):
                sinks = _sinks(kind, q, pool, d**-0.5)
                if not prompt:
                    got = op(q, pool, table, starts, ctx, d**-0.5, 0, sinks)
                elif torch.ops.pdserve_cpu.prefill_supported(d):
                    got = torch.ops.pdserve_cpu.paged_prefill_attention(
                        q, pool, table, starts, ctx, d**-0.5, 0, True, sinks
                    )
                else:
                    continue
                want = reference(q, pool, tables, q_lens, ctxs, block_size, d**-0.5, 0, sinks)
                _check(got, want, dtype, kind, f"one plane, d {d}, {'prompt' if prompt else 'decode'}")


def test_no_sinks_is_the_old_call(op):
    """Omitted, None and an empty tensor are the same call; -inf sinks add nothing to the sums."""
    rng = random.Random(3)
    kv = torch.randn(48, 2, 2, 8, 64, generator=torch.Generator().manual_seed(0))
    for batch, call in (
        (_decode_batch, op),
        (_prompt_batch, lambda *a, **kw: torch.ops.pdserve_cpu.paged_prefill_attention(*a[:7], True, **kw)),
    ):
        if batch is _prompt_batch and not torch.ops.pdserve_cpu.prefill_supported(64):
            continue
        tables, q_lens, ctxs = batch(rng, 48, 8)
        table, starts = index_tensors(tables, q_lens)
        q = torch.randn(sum(q_lens), 4, 64, generator=torch.Generator().manual_seed(2))
        args = (q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), 0.125, 5)
        plain = call(*args)
        assert torch.equal(call(*args, sinks=None), plain)
        assert torch.equal(call(*args, sinks=torch.empty(0)), plain)
        torch.testing.assert_close(call(*args, sinks=torch.full((4,), float("-inf"))), plain, atol=1e-6, rtol=1e-6)


def test_sinks_of_the_wrong_shape_are_refused(op):
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q, kv = torch.randn(1, 4, 16), torch.randn(2, 2, 2, 8, 16)
    args = (q, kv, i32([[0]]), i32([0, 1]), i32([1]), 1.0, 0)
    for bad in (torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="sinks must be"):
            op(*args, bad)
        if torch.ops.pdserve_cpu.prefill_supported(16):
            with pytest.raises(RuntimeError, match="sinks must be"):
                torch.ops.pdserve_cpu.paged_prefill_attention(*args, True, bad)


def _mixed_step(dtype: torch.dtype, d: int = 64):
    """Decode tokens, a short and a long chunk after cached context, and a fresh prompt."""
    g = torch.Generator().manual_seed(7)
    hkv, hq, bs = 2, 8, 4
    q_lens, ctxs = [1, 5, 40, 1, 30], [23, 17, 70, 9, 30]
    perm = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for c in ctxs:
        tables.append(perm[used : used + -(-c // bs)])
        used += len(tables[-1])
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    batch = ForwardBatch([f"s{i}" for i in range(5)], [7] * total, q_lens, ctxs, tables, [True] * 5)
    pool = torch.randn(64, 2, hkv, bs, d, generator=g).to(dtype)
    return q, k, v, pool, batch, tables, q_lens, ctxs, bs, torch.randn(hq, generator=g) * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt_kernel", [True, False])
def test_backend_runs_sinks_on_the_kernels(op, dtype, prompt_kernel, monkeypatch):
    """Never the torch path for the whole step; the decode rows always on the kernel; the prompts on
    the prompt kernel where it runs and otherwise (forced here) on `sink_attention`, never SDPA."""
    q, k, v, pool, batch, tables, q_lens, ctxs, bs, sinks = _mixed_step(dtype)
    backend = make_backend("cpu_paged")
    backend.wait_ready()
    assert backend.uses_kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the torch fallback ran a step with sinks")

    lengths: list[int] = []
    real = torch_backend.sink_attention
    monkeypatch.setattr(backend._fallback, "forward", refuse)
    monkeypatch.setattr(torch_backend, "sink_attention", lambda q, *a: lengths.append(q.shape[2]) or real(q, *a))
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", refuse)
    runs = torch.ops.pdserve_cpu.prefill_supported(64) and prompt_kernel
    if not runs:
        monkeypatch.setattr(backend, "_runs_prompts", lambda *a: False)
    for window in (0, 8):
        meta = AttentionMetadata.build(batch, bs, torch.device("cpu"))
        got = backend.forward(q, k, v, pool.clone(), meta, 0.125, window=window, sinks=sinks)
        pool_now = pool.clone()
        torch.ops.pdserve_cpu.store_kv(pool_now, k, v, meta.slot_blocks, meta.slot_offsets)
        want = reference(q, pool_now, tables, q_lens, ctxs, bs, 0.125, window, sinks)
        torch.testing.assert_close(got.double(), want, atol=_atol(dtype), rtol=0)
    # the long chunk (40 rows) and the fresh prompt (30) through sink_attention, once per window
    assert lengths == ([] if runs else [40, 30] * 2)
