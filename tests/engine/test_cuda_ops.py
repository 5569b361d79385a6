"""The fused CUDA elementwise ops (engine.cuda_ops) under Triton's interpreter on CPU, against
EagerOps; compiled on a GPU in tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.attention import triton_decode
from pdserve.engine.cuda_ops import CudaFusedOps
from pdserve.engine.layers import EagerOps

pytestmark = pytest.mark.skipif(
    not triton_decode.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (a GPU machine runs these compiled in tests/gpu)",
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INTERPRETER_BF16 = 2**-5
"""Triton's interpreter emulates bfloat16 with numpy and does not round float32 to it to nearest,
as the compiled conversion (and torch) does, and these ops round up to three times in a row:
bfloat16 results are checked to four ulps (relative, and absolute near 1) here and to two, compiled,
on a GPU (tests/gpu/test_cuda_graphs_gpu.py)."""
TWO_ULPS = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
"""Relative: one rounding landing on the other side of a half-ulp can differ twice over."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(5, 96).to(dtype)
    res = torch.randn(5, 96).to(dtype) if with_residual else None
    w = (torch.rand(96) + 0.5).to(dtype)
    x_eager, x_fused = x.clone(), x.clone()
    want = EagerOps.add_rms_norm(x_eager, res, w, 1e-6)
    got = CudaFusedOps.add_rms_norm(x_fused, res, w, 1e-6)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(x_fused, x_eager, atol=INTERPRETER_BF16, rtol=INTERPRETER_BF16)
    else:
        assert torch.equal(x_fused, x_eager)  # the residual stream: the same rounding
    # the mean of squares is summed in another order: a rounding may land on the other side
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(
        got, want, atol=INTERPRETER_BF16 if bf16 else 1e-6, rtol=TWO_ULPS[dtype] * (2 if bf16 else 1)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(1)
    gate_up = (torch.randn(3, 2 * 1500) * 3).to(dtype)  # wider than one block
    got, want = CudaFusedOps.silu_mul(gate_up), EagerOps.silu_mul(gate_up)
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(
        got, want, atol=INTERPRETER_BF16 if bf16 else 1e-6, rtol=TWO_ULPS[dtype] * (2 if bf16 else 1)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 40])
def test_rotary_in_place_equals_eager(dtype, d):
    from pdserve.engine.layers import RotaryEmbedding
    from pdserve.engine.model_config import ModelConfig

    torch.manual_seed(2)
    hq, hkv, t = 4, 2, 7
    cfg = ModelConfig.from_dict(
        dict(architectures=["LlamaForCausalLM"], hidden_size=hq * d, num_attention_heads=hq,
             num_key_value_heads=hkv, intermediate_size=64, num_hidden_layers=1, vocab_size=100,
             max_position_embeddings=512, head_dim=d)
    )  # fmt: skip
    cos, sin = RotaryEmbedding(cfg, torch.device("cpu")).cos_sin(torch.arange(100, 100 + t), dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    want = EagerOps.rotate_qk(qkv.clone(), cos, sin, hq, hkv, d)
    got = CudaFusedOps.rotate_qk(qkv.clone(), cos, sin, hq, hkv, d)
    rtol = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: INTERPRETER_BF16}[dtype]
    atol = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: INTERPRETER_BF16}[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
