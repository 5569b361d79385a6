"""The float64 reference and batch builders shared by the paged attention ops' tests
(test_cpu_paged_attention.py: decode kernels, test_cpu_prefill_attention.py: prompt kernels)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kernels.cpu_build import load_paged_attention_op

BF16_ATOL = 2e-2  # bf16 inputs/outputs (8-bit mantissa), float32 accumulation


@pytest.fixture(scope="module")
def op():
    """The compiled ops (built on first use)."""
    fn = load_paged_attention_op()
    assert fn is not None, "this machine has a C++ compiler: the op must build"
    return fn


def reference(q, kv, tables, q_lens, ctxs, block_size, scale, window=0, sinks=None):
    """Gather each sequence's keys position by position; exact causal softmax in float64, over the
    last `window` keys of each query (0: all of them). Values are plane 1 of kv [N, P, Hkv, B, D], or
    plane 0 of a one-plane (MLA) pool, whose latent is both. `sinks` [Hq] (gpt-oss): each head's
    logit is one more column of its scores, softmaxed with them and then dropped."""
    out, t = [], 0
    hq, hkv = q.shape[1], kv.shape[2]
    for table, q_len, ctx in zip(tables, q_lens, ctxs):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // block_size]
        keys = kv[blocks, 0, :, pos % block_size].double()  # [ctx, Hkv, D]
        values = kv[blocks, kv.shape[1] - 1, :, pos % block_size].double()
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
        for j in range(q_len):
            n = ctx - q_len + j + 1
            first = max(0, n - window) if window else 0
            scores = torch.einsum("hd,khd->hk", q[t].double(), keys[first:n]) * scale
            if sinks is not None:
                probs = torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
            else:
                probs = scores.softmax(-1)
            out.append(torch.einsum("hk,khd->hd", probs, values[first:n]))
            t += 1
    return torch.stack(out)


def index_tensors(tables: list[list[int]], q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' int32 block table [S, P] (zero-padded) and query starts [S + 1]."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return table, torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)


def place(rng: random.Random, free: list[int], block_size: int, draws: int, draw) -> tuple[list, list, list]:
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


def prompt_kernel_runs(d: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the engine sends prompts of this head size and dtype to the prompt kernel."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.pdserve_cpu.prefill_amx_supported(d))
    return bool(torch.ops.pdserve_cpu.prefill_supported(d))
