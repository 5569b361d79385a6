"""benchmarks/mla_attention.py: its two arms compute the same attention (the latent read in place with
absorbed up-projections, and per-head K/V expanded from the same latents), so the timing compares
like with like."""

from __future__ import annotations

import pytest
import torch

from benchmarks.mla_attention import LORA, ROPE, V, build, expanded_step, latent_step
from pdserve.engine.kernels.cpu_build import load_paged_attention_op


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_and_expanded_arms_agree(dtype, atol) -> None:
    op = load_paged_attention_op()
    assert op is not None, "this machine has a C++ compiler: the op must build"
    s = build(batch=3, ctx=70, layers=2, dtype=dtype, seed=1)
    assert s["latent"][0].shape[1:] == (1, 1, 16, LORA + ROPE)  # one plane: the latent, stored once
    scale = 0.1
    latent, expanded = latent_step(op, s, scale), expanded_step(op, s, scale)
    assert len(latent) == len(expanded) == 2
    for a, b in zip(latent, expanded):
        assert a.shape == b.shape == (3, 16, V)
        assert (a.float() - b.float()).abs().max().item() < atol
