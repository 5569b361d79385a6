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

from engine.attention.cpu_build import load_paged_attention_op

BF16_ATOL = 2e-2  # bf16 inputs/outputs (8-bit mantissa), float32 accumulation


@pytest.fixture(scope="module")
def op():
    fn = load_paged_attention_op()
    assert fn is not None, "this machine has a C++ compiler: the op must build"
    return fn


def _reference(q, kv, tables, q_lens, ctxs, block_size, scale, window=0):
    """Gather each sequence's keys position by position; exact causal softmax in float64, over the
    last `window` keys of each query (0: all of them)."""
    out, t = [], 0
    hq, hkv = q.shape[1], kv.shape[2]
    for table, q_len, ctx in zip(tables, q_lens, ctxs):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // block_size]
        keys = kv[blocks, 0, :, pos % block_size].double()  # [ctx, Hkv, D]
        values = kv[blocks, 1, :, pos % block_size].double()
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
        for j in range(q_len):
            n = ctx - q_len + j + 1
            first = max(0, n - window) if window else 0
            scores = torch.einsum("hd,khd->hk", q[t].double(), keys[first:n]) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values[first:n]))
            t += 1
    return torch.stack(out)


def _index_tensors(tables: list[list[int]], q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' int32 block table [S, P] (zero-padded) and query starts [S + 1]."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return table, torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)


def _place(rng: random.Random, free: list[int], block_size: int, draws: int, draw) -> tuple[list, list, list]:
    """Up to `draws` sequences, (q_len, ctx) = draw(), each given its pages from `free` while they last."""
    tables, q_lens, ctxs = [], [], []
    for _ in range(draws):
        q_len, ctx = draw()
        n = (ctx + block_size - 1) // block_size
        if n > len(free):
            break
        tables.append([free.pop() for _ in range(n)])
        q_lens.append(q_len)
        ctxs.append(ctx)
    return tables, q_lens, ctxs


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

    tables, q_lens, ctxs = _place(rng, free, block_size, rng.randrange(1, 7), draw)
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    table, starts = _index_tensors(tables, q_lens)
    scale = d**-0.5
    got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), scale)
    want = _reference(q, kv, tables, q_lens, ctxs, block_size, scale)
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
    table, starts = _index_tensors(tables, q_lens)
    for group in (1, 2, 3, 4, 5, 8):
        q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
        for window in (0, 21):
            got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window)
            want = _reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window)
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
    table, starts = _index_tensors(tables, [1] * len(ctxs))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = op(q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, kv, tables, [1] * len(ctxs), ctxs, block_size, d**-0.5, window)
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
    import engine.attention.cpu_build as build

    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_op", None)
    monkeypatch.setattr(build, "_thread", None)
    monkeypatch.setenv("PDSERVE_NO_CPU_KERNEL", "1")
    from engine.attention.cpu_paged_backend import CpuPagedAttention

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
    from engine.attention import make_backend
    from engine.attention.base import AttentionMetadata
    from engine.attention.cpu_paged_backend import CHUNK_SDPA_MIN_TOKENS
    from engine.forward_batch import ForwardBatch

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
        assert bool(calls) == _prompt_kernel_runs(d, dtype)
    want = _reference(q, pool, tables, q_lens, ctxs, bs, 0.125)  # the pool now holds this step's K/V too
    atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


def _prompt_kernel_runs(d: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the engine sends prompts of this head size and dtype to the prompt kernel."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.pdserve_cpu.prefill_amx_supported(d))
    return bool(torch.ops.pdserve_cpu.prefill_supported(d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(10))
def test_prompt_kernel_matches_reference(op, seed, dtype):
    """The prompt kernel (`paged_prefill_attention`) on fresh prompts and long chunks after a cached
    prefix: GQA groups 1-5 and 8 (64-row items that split a token's heads), head sizes 16-256, pages
    of 1-32 keys (chunks shorter than 16 keys, page ends mid-chunk), sliding windows, 1-3 threads."""
    rng = random.Random(100 + seed)
    d = rng.choice([16, 32, 64, 128, 256])
    if not _prompt_kernel_runs(d):
        pytest.skip("the prompt kernel needs AVX-512")
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 3, 4, 5, 8])
    block_size = rng.choice([1, 4, 8, 16, 32])
    window = rng.choice([0, 0, 7, 40])
    num_blocks = 400 // block_size + 8
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, 2, hkv, block_size, d, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)

    def draw() -> tuple[int, int]:
        ctx = rng.choice([16, 17, 63, 64, rng.randrange(16, 130)])
        return rng.choice([ctx, rng.randrange(16, ctx + 1)]), ctx  # a fresh prompt or a chunk after a prefix

    tables, q_lens, ctxs = _place(rng, free, block_size, rng.randrange(1, 4), draw)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    _check_prompt_kernel(q, kv, tables, q_lens, ctxs, block_size, window, 1e-5 if dtype == torch.float32 else BF16_ATOL)


def _check_prompt_kernel(q, kv, tables, q_lens, ctxs, block_size, window, atol, amx=True) -> None:
    """`paged_prefill_attention` on 1, 2 and 3 threads against the float64 reference."""
    d = q.shape[-1]
    table, starts = _index_tensors(tables, q_lens)
    want = _reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = torch.ops.pdserve_cpu.paged_prefill_attention(
                q, kv, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window, amx
            )
            assert got.dtype == q.dtype and got.shape == q.shape
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, msg=f"{threads} threads")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_bf16_prompt_kernels_match_reference(op, seed, amx):
    """bf16 prompts through the AMX kernel (`amx=True`, where `prefill_amx_supported`) and the AVX-512
    one: head sizes the tiles take (multiples of 32: O^T in the tiles up to 64, in memory above),
    prompts and chunks of up to 300 tokens (many 32-key chunks, the pipelined loop's first and last
    steps, items that split a token's heads), GQA groups, pages of 1-32 keys, sliding windows, scores
    large enough to move the running max by more than the lazy-rescale bound, 1-3 threads."""
    rng = random.Random(500 + seed)
    d = rng.choice([32, 64, 96, 128, 256])
    if not _prompt_kernel_runs(d):
        pytest.skip("the prompt kernel needs AVX-512")
    if amx and not torch.ops.pdserve_cpu.prefill_amx_supported(d):
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 3, 4])
    block_size = rng.choice([1, 16, 32, 7])
    window = rng.choice([0, 0, 33, 100])
    num_blocks = 700 // block_size + 8
    gen = torch.Generator().manual_seed(seed)
    # in some seeds K and V x4: scores spread widely, so later chunks move the max past the one in use
    kv = (torch.randn(num_blocks, 2, hkv, block_size, d, generator=gen) * rng.choice([1.0, 4.0])).bfloat16()
    free = list(range(num_blocks))
    rng.shuffle(free)

    def draw() -> tuple[int, int]:
        ctx = rng.choice([32, 33, 95, rng.randrange(16, 300)])
        return rng.choice([ctx, rng.randrange(16, ctx + 1)]), ctx

    tables, q_lens, ctxs = _place(rng, free, block_size, rng.randrange(1, 4), draw)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).bfloat16()
    # bf16 probabilities and output: the bound scales with the values (K and V x4 in some seeds)
    atol = BF16_ATOL * max(1.0, kv[:, 1].abs().max().item() / 4)
    _check_prompt_kernel(q, kv, tables, q_lens, ctxs, block_size, window, atol, amx)


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_kernel_takes_no_sequence_and_refuses_an_empty_pool_shape(op, dtype, amx):
    """An empty batch gives an empty output (the AMX kernel once divided by the number of sequences x
    kv heads: a crash of the process, not an error); a sliding window wider than 32 bits is no window
    (it wrapped to 0, masking every key); a pool with no kv heads or zero-token pages is refused by
    both ops."""
    if not _prompt_kernel_runs(64):
        pytest.skip("the prompt kernel needs AVX-512")
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q = torch.zeros(0, 4, 64, dtype=dtype)
    kv = torch.zeros(4, 2, 2, 16, 64, dtype=dtype)
    empty = torch.zeros(0, 1, dtype=torch.int32)
    got = torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, empty, i32([0]), i32([]), 0.125, 0, amx)
    assert got.shape == q.shape
    x = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    pages = torch.randn(4, 2, 2, 16, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = (pages, i32([[1]]), i32([0, 8]), i32([8]), 0.125)
    plain = torch.ops.pdserve_cpu.paged_prefill_attention(x, *args, 0, amx)
    for wide in (8, 2**31 - 1, 2**31, 2**40):  # windows as wide as the context or wider: no window at all
        torch.testing.assert_close(torch.ops.pdserve_cpu.paged_prefill_attention(x, *args, wide, amx), plain)
        torch.testing.assert_close(
            torch.ops.pdserve_cpu.paged_attention(x, *args, wide), torch.ops.pdserve_cpu.paged_attention(x, *args, 0)
        )
    for pool, match in ((torch.zeros(4, 2, 0, 16, 64, dtype=dtype), "head shapes"), (kv[:, :, :, :0], "block size")):
        with pytest.raises(RuntimeError, match=match):  # both were divisions by zero
            torch.ops.pdserve_cpu.paged_prefill_attention(
                torch.zeros(16, 4, 64, dtype=dtype),
                pool.contiguous(),
                i32([[0]]),
                i32([0, 16]),
                i32([16]),
                0.125,
                0,
                amx,
            )
        with pytest.raises(RuntimeError, match=match):
            torch.ops.pdserve_cpu.paged_attention(
                torch.zeros(16, 4, 64, dtype=dtype), pool.contiguous(), i32([[0]]), i32([0, 16]), i32([16]), 0.125, 0
            )


def test_prompt_kernel_reads_a_query_view_and_refuses_what_it_cannot_run(op):
    """q may be a row view of the fused qkv projection; bad pages are refused as by the decode op, and a
    head size the kernel has no code for is an error, not a wrong answer."""
    if not _prompt_kernel_runs(64):
        pytest.skip("the prompt kernel needs AVX-512")
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 64, 16
    qkv = torch.randn(40, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(40, hq, d)
    kv = torch.randn(4, 2, hkv, bs, d, generator=gen)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    got = torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, i32([[2, 0, 3]]), i32([0, 40]), i32([40]), 0.125, 0)
    want = _reference(q, kv, [[2, 0, 3]], [40], [40], bs, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, i32([[2, 0, 4]]), i32([0, 40]), i32([40]), 0.125, 0)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, i32([[2, 0]]), i32([0, 40]), i32([40]), 0.125, 0)
    odd = torch.randn(20, 2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.pdserve_cpu.paged_prefill_attention(
            odd, torch.randn(2, 2, 1, 16, 40), i32([[0, 1]]), i32([0, 20]), i32([20]), 0.125, 0
        )
