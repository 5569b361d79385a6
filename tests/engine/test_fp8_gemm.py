"""The FP8 GEMM (engine/fp8.py) held to its contract on CPU, where no FP8 GEMM can run: what a torch
upgrade or a layout mistake would break fails here, not first on a Hopper GPU.

(a) the 1x128 activation quantizer equals a plain per-group reference and round-trips within e4m3
precision; (b) a CPU emulation of the block-scaled GEMM (per 128-wide K block: an exact float32
product of the FP8 values, times the row's and the weight block's scales, summed) equals
dequantize(x_q) @ dequantize(w).T and is close to the unquantized product; (c) `F.scaled_mm`, the
`ScalingType` members and the aten op exist as called, and the operands `Fp8Linear` builds pass
torch's own checks of `_scaled_mm_v2` (its meta kernel, which applies the CUDA layout rules: row-major
A, column-major B, M-major 1x128 scales, [L4, N/128] 128x128 scales). Loading is in
test_fp8_loading.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import fp8
from pdserve.engine.fp8 import (
    AMAX_EPS,
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8_block,
    quantize_1x128,
    scale_a_layout,
    scale_b_layout,
)
from tests.engine.fp8_reference import (
    dequantize_act,
    emulated_block_scaled_mm,
    quantize_weight,
    reference_quantize,
)


# (a) the activation quantizer


def test_quantizer_equals_the_reference_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 384, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 128:256] = 0.0  # an all-zero group: amax clamped to eps, values quantize to 0
    x[3, :128] *= 1e-12  # a group below the eps floor
    x = x.to(torch.bfloat16)
    q, s = quantize_1x128(x)
    rq, rs = reference_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 384) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (7, 3)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    assert s[2, 1].item() == pytest.approx(AMAX_EPS / FP8_MAX) and not q[2, 128:256].float().any()
    # each group's largest magnitude lands on +-448 (saturated, never NaN)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((7,), 448.0))


def test_quantizer_round_trips_within_e4m3_precision():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 256, generator=gen) * 5
    q, s = quantize_1x128(x)
    back = dequantize_act(q, s)
    scale = s.repeat_interleave(128, dim=1)
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormals in steps of 2^-9 (half-step 2^-10)
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back - x).abs().max() > 0  # lossy: the tests below would not notice a no-op quantizer


def test_quantizer_refuses_a_width_off_the_groups():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_1x128(torch.zeros(2, 200))


# (b) the block-scaled GEMM, emulated


@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (5, 384, 256), (64, 256, 512)])
def test_emulated_gemm_equals_the_dequantized_product(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w_true = torch.randn(n, k, generator=gen) * k**-0.5
    w, w_scale = quantize_weight(w_true)
    x_q, x_scale = quantize_1x128(x)
    got = emulated_block_scaled_mm(x_q, scale_a_layout(x_scale), w, scale_b_layout(w_scale), torch.float32)
    dequant = dequantize_act(x_q, x_scale) @ dequantize_fp8_block(w, w_scale, (128, 128), "w").t()
    assert torch.allclose(got, dequant, rtol=1e-5, atol=1e-5)
    exact = x @ w_true.t()
    cosine = F.cosine_similarity(got.flatten(), exact.flatten(), dim=0).item()
    assert cosine > 0.999, cosine
    assert (got - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_fp8_linear_on_the_emulated_gemm(monkeypatch, rows):
    """Fp8Linear's call (row padding to 4, layouts, bias, leading dims) over the emulated GEMM equals
    the dequantized linear on the quantized activations."""
    monkeypatch.setattr(fp8, "block_scaled_mm", emulated_block_scaled_mm)
    gen = torch.Generator().manual_seed(rows)
    w, w_scale = quantize_weight(torch.randn(256, 384, generator=gen) * 0.05)
    bias = torch.randn(256, generator=gen).to(torch.bfloat16)
    lin = Fp8Linear(w, w_scale, torch.bfloat16, bias)
    x = torch.randn(2, rows, 384, generator=gen).to(torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, rows, 256) and y.dtype == torch.bfloat16
    x_q, x_scale = quantize_1x128(x.reshape(-1, 384))
    want = dequantize_act(x_q, x_scale) @ dequantize_fp8_block(w, w_scale, (128, 128), "w").t()
    want = want.to(torch.bfloat16) + bias
    assert torch.allclose(y.float().reshape(-1, 256), want.float(), atol=2e-2, rtol=1e-2)
    assert lin.nbytes == 256 * 384 + 4 * 2 * 4  # the FP8 weight and its [L4=4, N/128=2] scales
    assert torch.equal(lin.scale_inv, w_scale)


# (c) the torch API called, and the layouts it requires


def test_torch_has_the_block_scaled_gemm_called():
    params = inspect.signature(F.scaled_mm).parameters
    for name in ("mat_a", "mat_b", "scale_a", "scale_recipe_a", "scale_b", "scale_recipe_b", "output_dtype"):
        assert name in params, f"torch.nn.functional.scaled_mm lost its {name!r} parameter"
    assert params["use_fast_accum"].default is False  # the accurate accumulation is the default we rely on
    assert hasattr(F.ScalingType, "BlockWise1x128") and hasattr(F.ScalingType, "BlockWise128x128")
    schema = str(torch.ops.aten._scaled_mm_v2.default._schema)
    assert "Tensor[] scale_a, int[] recipe_a" in schema and "Tensor[] scale_b, int[] recipe_b" in schema
    assert fp8._torch_has_block_scaled_mm()


def test_torch_meta_kernel_enforces_the_layouts():
    """The negative control: torch's meta kernel does check what the next test relies on, so the
    layouts passing it means something."""
    m, n, k = 4, 256, 256
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    good_a, good_b = scale_a_layout(torch.empty(m, 2, device="meta")), scale_b_layout(torch.empty(2, 2, device="meta"))
    fp8.block_scaled_mm(a, good_a, w, good_b, torch.bfloat16)
    with pytest.raises(RuntimeError, match="1x128 x 128x128"):
        fp8.block_scaled_mm(a, torch.empty(m, 2, device="meta"), w, good_b, torch.bfloat16)  # K-major scale_a
    with pytest.raises(RuntimeError, match="1x128 x 128x128"):
        fp8.block_scaled_mm(a, good_a, w, torch.empty(2, 2, device="meta").t(), torch.bfloat16)  # unpadded
    with pytest.raises(RuntimeError, match="col_major"):
        F.scaled_mm(a, w, good_a, F.ScalingType.BlockWise1x128, good_b, F.ScalingType.BlockWise128x128)


@pytest.mark.parametrize("n, k", [(128, 128), (512, 128), (128, 384), (768, 1024), (256, 640)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 256])
def test_fp8_linear_operands_pass_torch_checks(n, k, rows):
    """Fp8Linear's whole call on meta tensors: torch's `_scaled_mm_v2` meta kernel validates the
    operands it builds (shapes, strides, dtypes) for each of these shapes."""
    lin = Fp8Linear(
        torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(n // 128, k // 128, device="meta"),
        torch.bfloat16,
    )
    l4 = -(-(k // 128) // 4) * 4
    assert lin.scale_b.shape == (l4, n // 128) and lin.scale_b.stride() == (1, l4)
    assert lin.scale_b.dtype == torch.float32
    assert lin.qweight.t().stride() == (1, k)  # mat_b: column-major [K, N]
    y = lin(torch.empty(rows, k, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    _, x_scale = quantize_1x128(torch.empty(rows + (-rows % 4), k, device="meta"))
    laid = scale_a_layout(x_scale)
    assert laid.shape == (rows + (-rows % 4), k // 128) and laid.stride()[0] == 1


def test_fp8_linear_refuses_what_the_gemm_cannot_take():
    w = torch.zeros(192, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 128"):
        Fp8Linear(w, torch.ones(2, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Fp8Linear(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), torch.float32)
