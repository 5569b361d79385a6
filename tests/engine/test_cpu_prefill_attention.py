"""The prompt kernels of the cpu_paged op (`paged_prefill_attention`: the AVX-512 one and, in bf16,
the AMX one) against the float64 reference: fresh prompts and long chunks after a cached prefix, GQA,
page sizes, sliding windows, threads, degenerate inputs."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.paged_reference import BF16_ATOL, index_tensors, op, place, prompt_kernel_runs, reference

__all__ = ["op"]  # the fixture


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(10))
def test_prompt_kernel_matches_reference(op, seed, dtype):
    """The prompt kernel (`paged_prefill_attention`) on fresh prompts and long chunks after a cached
    prefix: GQA groups 1-5 and 8 (64-row items that split a token's heads), head sizes 16-256, pages
    of 1-32 keys (chunks shorter than 16 keys, page ends mid-chunk), sliding windows, 1-3 threads."""
    rng = random.Random(100 + seed)
    d = rng.choice([16, 32, 64, 128, 256])
    if not prompt_kernel_runs(d):
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

    tables, q_lens, ctxs = place(rng, free, block_size, rng.randrange(1, 4), draw)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    _check_prompt_kernel(q, kv, tables, q_lens, ctxs, block_size, window, 1e-5 if dtype == torch.float32 else BF16_ATOL)


def _check_prompt_kernel(q, kv, tables, q_lens, ctxs, block_size, window, atol, amx=True) -> None:
    """`paged_prefill_attention` on 1, 2 and 3 threads against the float64 reference."""
    d = q.shape[-1]
    table, starts = index_tensors(tables, q_lens)
    want = reference(q, kv, tables, q_lens, ctxs, block_size, d**-0.5, window)
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
    if not prompt_kernel_runs(d):
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

    tables, q_lens, ctxs = place(rng, free, block_size, rng.randrange(1, 4), draw)
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
    if not prompt_kernel_runs(64):
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
    if not prompt_kernel_runs(64):
        pytest.skip("the prompt kernel needs AVX-512")
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 64, 16
    qkv = torch.randn(40, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(40, hq, d)
    kv = torch.randn(4, 2, hkv, bs, d, generator=gen)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    got = torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, i32([[2, 0, 3]]), i32([0, 40]), i32([40]), 0.125, 0)
    want = reference(q, kv, [[2, 0, 3]], [40], [40], bs, 0.125)
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
