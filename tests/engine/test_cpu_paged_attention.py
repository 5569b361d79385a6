"""The cpu_paged C++ op against a float64 reference on random ragged batches.

Covers decode tokens, chunks after a cached prefix, GQA group sizes 1..5 and 8, odd
head sizes (not a multiple of the 16-lane loops), contexts ending exactly on and
one past a block boundary, and non-contiguous block tables, in every kernel variant
the CPU runs (8 lanes, 16 lanes, bf16 scores by vdpbf16ps).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.paged_reference import BF16_ATOL, index_tensors, op, place, prompt_kernel_runs, reference

__all__ = ["op"]  # the fixture, shared with the prompt kernels' tests


KERNELS = {"narrow": 0, "wide": 1, "dot": 2}
"""What `torch.ops.pdserve_cpu.attention_kernels()` reports for each variant of the op's kernels."""


@pytest.fixture(params=list(KERNELS))
def kernels(request, op, monkeypatch):
    """Each kernel variant this CPU has: the 8-lane build (any x86-64), the 16-lane one (AVX-512) and
    bf16 scores by vdpbf16ps (AVX512-BF16); the op reads its switches at every call."""
    if request.param == "narrow":
        monkeypatch.setenv("PDSERVE_CPU_NARROW", "1")
    elif request.param == "wide":
        monkeypatch.setenv("PDSERVE_CPU_NO_BF16_DOT", "1")
    if torch.ops.pdserve_cpu.attention_kernels() != KERNELS[request.param]:
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_on_random_ragged_batches(op, kernels, seed, dtype):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 3, 4, 5, 8])  # 5 and 8: the wide kernels take 2-4 heads a call, then the rest
    d = rng.choice([8, 17, 32, 33, 64, 80, 128, 256])  # 32-256: register-held accumulators (8 or 16 lanes)
    block_size = rng.choice([1, 4, 16])
    num_blocks = 96
    kv = torch.randn(num_blocks, 2, hkv, block_size, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are scattered, not increasing

    def draw() -> tuple[int, int]:
        boundary = block_size * rng.randrange(1, 4)
        ctx = rng.choice([1, boundary, boundary + 1, rng.randrange(1, 60)])
        return rng.choice([1, 1, min(ctx, rng.randrange(1, 9))]), ctx  # decode token or a chunk after a prefix

    tables, q_lens, ctxs = place(rng, free, block_size, rng.randrange(1, 7), draw)
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    table, starts = index_tensors(tables, q_lens)
    scale = d**-0.5
    got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), scale)
    want = reference(q, kv, tables, q_lens, ctxs, block_size, scale)
    atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_register_held_head_sizes_match_reference(op, kernels, dtype, d):
    """Head sizes of whole vectors, in blocks of 16: the wide kernels keep the accumulators of 1-4
    query heads in registers over every page (GQA groups 1-5 and 8, so each sweep width and a
    remainder) and ask for the page ahead a row per key; bf16 values go through even / odd
    registers. Contexts end before, on and after page boundaries; windows start inside a page."""
    block_size, hkv = 16, 2
    gen = torch.Generator().manual_seed(d)
    ctxs, q_lens = [1, 15, 16, 17, 40, 95, 96], [1, 1, 1, 1, 5, 1, 3]
    pages = [(c + block_size - 1) // block_size for c in ctxs]
    free = list(range(sum(pages) + 4))
    random.Random(d).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    kv = torch.randn(sum(pages) + 4, 2, hkv, block_size, d, generator=gen).to(dtype)
    table, starts = index_tensors(tables, q_lens)
    for group in (1, 2, 3, 4, 5, 8):
        q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
        for window in (0, 21):
            got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window)
            want = reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window)
            atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, msg=f"group {group} window {window}")


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("window", [0, 100])
def test_long_ragged_decode_split_across_threads(op, kernels, threads, window):
    """Enough keys for one range of items per thread, split by keys (contexts 1..700): every item is
    computed once, whichever range it falls in."""
    rng = random.Random(threads * 10 + window)
    hkv, hq, d, block_size = 2, 6, 64, 16
    dtype = torch.bfloat16 if kernels == "dot" else torch.float32  # dot: the bf16 scores instruction
    ctxs = [rng.choice([1, 17, rng.randrange(1, 700), rng.randrange(300, 700)]) for _ in range(64)]
    pages = [(c + block_size - 1) // block_size for c in ctxs]
    free = list(range(sum(pages) + 8))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    gen = torch.Generator().manual_seed(threads)
    kv = torch.randn(len(free) + sum(pages), 2, hkv, block_size, d, generator=gen).to(dtype)
    q = torch.randn(len(ctxs), hq, d, generator=gen).to(dtype)
    table, starts = index_tensors(tables, [1] * len(ctxs))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window)
    finally:
        torch.set_num_threads(before)
    want = reference(q, kv, tables, [1] * len(ctxs), ctxs, block_size, d**-0.5, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5 if dtype == torch.float32 else BF16_ATOL, rtol=0)


def test_rejects_mismatched_shapes(op):
    q = torch.randn(2, 4, 16)
    kv = torch.randn(4, 2, 3, 8, 16)  # 4 query heads over 3 kv heads: not a whole group
    with pytest.raises(RuntimeError, match="head shapes"):
        op(
            q,
            kv,
            torch.zeros(2, 1, dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([1, 1], dtype=torch.int32),
            1.0,
        )


@pytest.mark.parametrize(
    "table, starts, ctxs, match",
    [
        ([[0, 1]], [0, 1], [40], "do not fit"),  # 40 keys in 2 pages of 8
        ([[0, 9]], [0, 1], [12], "not in the pool"),  # block 9 of 4
        ([[0, -1]], [0, 1], [12], "not in the pool"),
        ([[0, 1]], [0, 3], [2], "do not fit"),  # 3 query tokens in a context of 2
        ([[0, 1]], [1, 1], [2], "query_start must run"),
        ([[0, 1], [2, 3]], [0, 3, 1], [4, 4], "do not fit"),  # the first sequence's tokens run past the last
        ([[0, 1], [2, 3]], [0, 1], [2, 2], "must match"),  # 2 sequences, 1 query_start interval
    ],
)
def test_rejects_what_would_read_outside_the_pool(op, table, starts, ctxs, match):
    """Bad tables, contexts and query starts are refused before any page is read."""
    q = torch.randn(max(starts[-1], 1), 4, 16)
    kv = torch.randn(4, 2, 2, 8, 16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        op(q, kv, i32(table), i32(starts), i32(ctxs), 1.0)


def test_backend_falls_back_without_the_op(monkeypatch):
    """No compiler (forced here) must still give a working backend: the torch path."""
    import pdserve.engine.kernels.cpu_build as build

    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_op", None)
    monkeypatch.setattr(build, "_thread", None)
    monkeypatch.setenv("PDSERVE_NO_CPU_KERNEL", "1")
    from pdserve.engine.attention.cpu_paged_backend import CpuPagedAttention

    backend = CpuPagedAttention()
    backend.wait_ready()  # the background build has decided (and will not run again)
    assert not backend.uses_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_index_assignment(op, dtype):
    """The op's KV write equals torch's advanced-index assignment, for strided k/v row views."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(9, 2, 3, 8, 17, generator=g).to(dtype)
    qkv = torch.randn(11, (5 + 2 * 3) * 17, generator=g).to(dtype)  # k, v: row views of a fused projection
    k = qkv[:, 5 * 17 : 8 * 17].view(11, 3, 17)
    v = qkv[:, 8 * 17 :].view(11, 3, 17)
    slots = torch.randperm(9 * 8, generator=g)[:11]
    blocks, offsets = slots // 8, slots % 8
    expected = kv.clone()
    expected[:, 0][blocks, :, offsets] = k
    expected[:, 1][blocks, :, offsets] = v
    torch.ops.pdserve_cpu.store_kv(kv, k, v, blocks, offsets)
    assert torch.equal(kv, expected)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        torch.ops.pdserve_cpu.store_kv(kv, k[:1], v[:1], torch.tensor([9]), torch.tensor([0]))


@pytest.mark.parametrize("backend_name", ["cpu_paged", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [40, 64])
def test_backends_on_a_mixed_step_match_the_reference(op, backend_name, dtype, d, monkeypatch):
    """One step mixing every path a backend takes: decode tokens and a short chunk (the kernel), a long
    chunk after a cached prefix (gathered pages through SDPA) and a fresh prompt (causal SDPA); with
    cpu_paged and a head size of 64 those two go to the prompt kernel instead, in float32 on AVX-512
    and in bfloat16 on AMX tiles."""
    from pdserve.engine.attention import make_backend
    from pdserve.engine.attention.base import AttentionMetadata
    from pdserve.engine.attention.cpu_paged_backend import CHUNK_SDPA_MIN_TOKENS
    from pdserve.engine.forward_batch import ForwardBatch

    g = torch.Generator().manual_seed(11)
    hkv, hq, bs = 2, 6, 4
    q_lens = [1, 5, CHUNK_SDPA_MIN_TOKENS + 21, 1, 30]
    ctxs = [23, 17, 70, 9, 30]  # the last is a fresh prompt (q_len == ctx)
    perm = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for c in ctxs:
        n = -(-c // bs)
        tables.append(perm[used : used + n])
        used += n
    kv = torch.randn(64, 2, hkv, bs, d, generator=g).to(dtype)
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    batch = ForwardBatch([f"s{i}" for i in range(5)], [7] * total, q_lens, ctxs, tables, [True] * 5)
    meta = AttentionMetadata.build(batch, bs, torch.device("cpu"))
    backend = make_backend(backend_name)
    calls = []
    if backend_name == "cpu_paged":
        backend.wait_ready()
        assert backend.uses_kernel
        prompt_op = torch.ops.pdserve_cpu.paged_prefill_attention
        monkeypatch.setattr(
            torch.ops.pdserve_cpu, "paged_prefill_attention", lambda *a: calls.append(1) or prompt_op(*a)
        )
    pool = kv.clone()
    got = backend.forward(q, k, v, pool, meta, 0.125)
    if backend_name == "cpu_paged":
        assert bool(calls) == prompt_kernel_runs(d, dtype)
    want = reference(q, pool, tables, q_lens, ctxs, bs, 0.125)  # the pool now holds this step's K/V too
    atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)
