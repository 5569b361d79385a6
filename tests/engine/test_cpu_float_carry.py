"""CpuCarryOps (bf16 model, float32 GEMMs): the fused ops that take unrounded float32 GEMM outputs
and hand float32-held bf16 values to the next GEMM compute what CpuFusedOps computes in bf16."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels.cpu_build import load_paged_attention_op
from pdserve.engine.layers import (
    CpuCarryOps,
    CpuFusedOps,
    EagerOps,
    Linear,
    RotaryEmbedding,
    bf16_via_float32,
    can_prepack,
)

SHAPES = [(1, 768), (1, 77), (37, 777), (200, 64)]


@pytest.fixture(scope="module", autouse=True)
def ops_built():
    assert load_paged_attention_op() is not None, "this machine has a C++ compiler: the ops must build"


def _is_bf16_valued(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and torch.equal(t, t.bfloat16().float())


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_carry_equals_the_bf16_op(rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden + 1)
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    gemm_out = torch.randn(rows, hidden, generator=g) if with_residual else None  # unrounded float32
    weight = torch.randn(hidden, generator=g).bfloat16()
    x_ref, x_carry = x.clone(), x.clone()
    rounded = gemm_out.bfloat16() if gemm_out is not None else None
    want = CpuFusedOps.add_rms_norm(x_ref, rounded, weight, 1e-5)
    got = CpuCarryOps.add_rms_norm(x_carry, gemm_out, weight, 1e-5)
    assert torch.equal(x_carry, x_ref), "the stream gets the bf16-rounded residual, as the eager add"
    assert _is_bf16_valued(got) and torch.equal(got.bfloat16(), want)


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_silu_mul_carry_equals_the_bf16_op(rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden + 2)
    gate_up = torch.randn(rows, 2 * hidden, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got = CpuCarryOps.silu_mul(gate_up)
    assert _is_bf16_valued(got)
    assert torch.equal(got.bfloat16(), CpuFusedOps.silu_mul(gate_up.bfloat16()))
    torch.testing.assert_close(got, EagerOps.silu_mul(gate_up.bfloat16()).float(), rtol=2**-7, atol=1e-6)


def test_bad_inputs_are_refused():
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16()
    with pytest.raises(RuntimeError, match="float32 like x"):
        CpuCarryOps.add_rms_norm(x, torch.randn(2, 8).bfloat16(), w, 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16"):
        CpuCarryOps.add_rms_norm(x.float(), None, w, 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        CpuCarryOps.silu_mul(torch.randn(2, 8).bfloat16())


def test_linear_float_out_is_the_unrounded_call():
    if not can_prepack(torch.bfloat16, torch.device("cpu")) or not bf16_via_float32():
        pytest.skip("this CPU has oneDNN bf16 kernels: no float32 carry")
    g = torch.Generator().manual_seed(3)
    lin = Linear(torch.randn(16, 8, generator=g).bfloat16(), prepack=True)
    x = torch.randn(5, 8, generator=g).bfloat16()
    raw = CpuCarryOps.linear(lin, x)
    assert raw.dtype == torch.float32 and torch.equal(raw.bfloat16(), lin(x))
    assert torch.equal(CpuCarryOps.linear(lin, x.float()), raw), "float32-held bf16 input: the same GEMM"


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("hq,hkv,d", [(12, 4, 64), (7, 7, 18), (3, 1, 130)])
def test_rotate_qk_carry_equals_the_bf16_op(rows, hq, hkv, d):
    g = torch.Generator().manual_seed(rows * d + hq + 4)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)  # unrounded float32 GEMM output
    cos, sin = RotaryEmbedding(_Rope(d), torch.device("cpu")).cos_sin(
        torch.randint(0, 4096, (rows,), generator=g), torch.bfloat16
    )
    got = CpuCarryOps.rotate_qk(qkv, cos, sin, hq, hkv, d)
    want = CpuFusedOps.rotate_qk(qkv.bfloat16(), cos, sin, hq, hkv, d)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


class _Rope:
    def __init__(self, head_dim: int) -> None:
        self.head_dim, self.rope_theta, self.rope_scaling = head_dim, 10000.0, None
        self.rotary_dim = head_dim


def test_a_bf16_model_gives_the_same_logits_with_and_without_the_carry(tiny_model_dir):
    """The whole decoder, prefill then decode: CpuCarryOps changes no bit of the logits."""
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, dtype="bfloat16", num_kv_blocks=8, attention_backend="cpu_paged")
    runner.attention.wait_ready()
    if not runner.model.carry:
        pytest.skip("this CPU runs bf16 GEMMs natively: no float32 carry")
    prefill = ForwardBatch(["a"], list(range(5, 25)), [20], [20], [[0, 1]], [True])
    decode = ForwardBatch(["a"], [9], [1], [21], [[0, 1]], [True])
    got = {}
    for carry in (True, False):
        runner.model.carry = carry
        got[carry] = [runner.run(prefill), runner.run(decode)]
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
