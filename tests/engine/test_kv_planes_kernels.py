"""The compiled CPU ops on a one-plane pool layer kv [N, 1, 1, B, D] (DeepSeek's MLA): one latent row
per token is both the key and the value, Hq query heads attend to it (MQA). Every kernel variant the
CPU runs (decode: 8 lanes, 16 lanes, bf16 dot; prompts: the AVX-512 kernel) against the float64
reference, at latent widths of tiny test models (48, 96) and DeepSeek's (576)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.paged_reference import BF16_ATOL, index_tensors, op, place, prompt_kernel_runs, reference
from tests.engine.test_cpu_paged_attention import kernels

__all__ = ["op", "kernels"]  # the fixtures

LATENT_WIDTHS = [48, 96, 64, 128, 256, 576]
"""48 = 32 + 16 and 96 = 64 + 32 (tiny MLA configs, the general head-size path), 576 = 512 + 64
(DeepSeek-V2/V3); 64-256 take the register-held accumulators."""


def _atol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else BF16_ATOL


def _latent_pool(num_blocks: int, block_size: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(num_blocks, 1, 1, block_size, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", LATENT_WIDTHS)
def test_decode_kernel_reads_the_latent_as_key_and_value(op, kernels, dtype, d):
    """Decode tokens and short chunks after a cached prefix, 8 and 16 query heads over the one latent,
    contexts ending before, on and after page boundaries, with and without a window."""
    rng = random.Random(d)
    block_size = 16
    pool = _latent_pool(64, block_size, d, dtype, seed=d)
    free = list(range(64))
    rng.shuffle(free)

    def draw() -> tuple[int, int]:
        ctx = rng.choice([1, 15, 16, 17, rng.randrange(1, 120)])
        return rng.choice([1, 1, min(ctx, rng.randrange(1, 9))]), ctx

    tables, q_lens, ctxs = place(rng, free, block_size, 6, draw)
    table, starts = index_tensors(tables, q_lens)
    for hq in (8, 16):
        q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(hq)).to(dtype)
        for window in (0, 21):
            got = op(q, pool, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, window)
            want = reference(q, pool, tables, q_lens, ctxs, block_size, d**-0.5, window)
            assert got.shape == q.shape and got.dtype == dtype
            torch.testing.assert_close(got.double(), want, atol=_atol(dtype), rtol=0, msg=f"hq {hq} window {window}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 96, 64])
def test_prompt_kernel_reads_the_latent_as_key_and_value(op, dtype, d):
    """Fresh prompts and long chunks after a cached prefix through `paged_prefill_attention`, where
    this CPU runs it for the latent width (576 never: the engine keeps SDPA there)."""
    if not prompt_kernel_runs(d, dtype):
        pytest.skip(f"this CPU sends no {dtype} prompt of head size {d} to the prompt kernel")
    rng = random.Random(7 * d)
    block_size = 8
    pool = _latent_pool(48, block_size, d, dtype, seed=3)
    free = list(range(48))
    rng.shuffle(free)
    tables, q_lens, ctxs = place(rng, free, block_size, 3, lambda: rng.choice([(40, 40), (20, 70), (16, 16)]))
    q = torch.randn(sum(q_lens), 8, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    table, starts = index_tensors(tables, q_lens)
    got = torch.ops.pdserve_cpu.paged_prefill_attention(
        q, pool, table, starts, torch.tensor(ctxs, dtype=torch.int32), d**-0.5, 0
    )
    want = reference(q, pool, tables, q_lens, ctxs, block_size, d**-0.5)
    torch.testing.assert_close(got.double(), want, atol=_atol(dtype), rtol=0)


def test_the_prompt_kernel_never_takes_deepseeks_latent_width(op):
    """576 is beyond the prompt kernels' head sizes: the cpu_paged backend keeps SDPA for it."""
    assert not torch.ops.pdserve_cpu.prefill_supported(576)
    assert not torch.ops.pdserve_cpu.prefill_amx_supported(576)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_latent_once(op, dtype):
    """One plane: the op writes k into plane 0 and never reads v (the model passes the same tensor;
    a different one here shows it is ignored), and no slot outside the step's changes."""
    g = torch.Generator().manual_seed(9)
    pool = torch.randn(6, 1, 1, 4, 48, generator=g).to(dtype)
    latent = torch.randn(7, 1, 48, generator=g).to(dtype)
    slots = torch.randperm(6 * 4, generator=g)[:7]
    blocks, offsets = slots // 4, slots % 4
    expected = pool.clone()
    expected[:, 0][blocks, :, offsets] = latent
    torch.ops.pdserve_cpu.store_kv(pool, latent, torch.full_like(latent, 99.0), blocks, offsets)
    assert torch.equal(pool, expected)
    torch.ops.pdserve_cpu.store_kv(pool, latent, latent, blocks, offsets)  # as the model calls it
    assert torch.equal(pool, expected)


def test_three_planes_are_refused(op):
    """Only K/V pairs and a single latent are layouts the kernels know."""
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    kv = torch.zeros(4, 3, 1, 8, 16)
    with pytest.raises(RuntimeError, match="P = 2"):
        op(torch.zeros(1, 2, 16), kv, i32([[0]]), i32([0, 1]), i32([1]), 1.0)
    with pytest.raises(RuntimeError, match="P = 2"):
        torch.ops.pdserve_cpu.store_kv(
            kv, torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.tensor([0]), torch.tensor([0])
        )
