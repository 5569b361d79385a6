"""`pdserve.engine.layers.Linear`: oneDNN-prepacked weights compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers import Linear, bf16_via_float32, can_prepack

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_equals_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    if not can_prepack(dtype, CPU):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=g) * 0.05).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if with_bias else None
    # a strided view, as the model passes slices of wider tensors
    x = torch.randn(rows, 160, generator=g).to(dtype)[:, ::2]
    want = F.linear(x, weight, bias)
    got = Linear(weight, bias, prepack=True)(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and bf16_via_float32():
        # float32 GEMM of the widened operands, rounded once: a bf16 GEMM with float32 accumulation
        exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding
        assert (got != want).float().mean() < 0.05  # and F.linear's bits, but for summation-order ties
    elif dtype == torch.bfloat16:
        assert torch.equal(got, want)  # the same oneDNN kernel, minus the per-call reorder
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # MKL vs oneDNN: summation order


def test_plain_linear_keeps_the_weight_and_packed_drops_it() -> None:
    weight = torch.randn(8, 4)
    plain = Linear(weight)
    assert plain.weight is weight and plain.packed is None and plain.nbytes == 8 * 4 * 4
    if can_prepack(torch.float32, CPU):
        packed = Linear(weight, prepack=True)
        assert packed.weight is None and packed.packed is not None and packed.nbytes == plain.nbytes


def test_bf16_through_float32_keeps_bf16_outputs() -> None:
    if not can_prepack(torch.bfloat16, CPU) or not bf16_via_float32():
        pytest.skip("this CPU has oneDNN bf16 kernels: bf16 weights are packed as bf16")
    weight = torch.randn(8, 4).bfloat16()
    lin = Linear(weight, torch.zeros(8, dtype=torch.bfloat16), prepack=True)
    assert lin.out_dtype == torch.bfloat16 and lin.nbytes == 8 * 4 * 4  # packed as float32
    assert lin(torch.randn(3, 4).bfloat16()).dtype == torch.bfloat16


def test_no_prepacking_off_cpu_or_for_float16() -> None:
    assert not can_prepack(torch.float16, CPU)
    assert not can_prepack(torch.float32, torch.device("meta"))
