"""`pdserve_cpu.f32_linear` (csrc/cpu_f32_linear.cpp) and `Linear`'s use of it for decode-sized
float32 batches: against a float64 reference and oneDNN's result on the same packed weight, every
row-tile remainder (1-5 rows over a multiple of 6), more rows than one pass over the weights takes,
K in whole and partial chunks, bias, row-strided inputs and bad inputs. Needs a CPU with AVX-512; the
dispatch tests also hold where it has none (the op is never used).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_build
from pdserve.engine.layers import F32_MAX_ROWS, Linear, f32_layout


@pytest.fixture(scope="module")
def avx512() -> bool:
    assert cpu_build.load_paged_attention_op() is not None, "this machine has a C++ compiler: the ops must build"
    return bool(torch.ops.pdserve_cpu.f32_linear_available())


def _needs_avx512(avx512: bool) -> None:
    if not avx512:
        pytest.skip("this CPU has no AVX-512")


def _problem(rows: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k + 40, generator=g)[:, 5 : 5 + k]  # rows apart in memory, as slices are
    return x, weight, b


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 summation error over K terms (with room), per output."""
    return (x.double().abs() @ weight.double().abs().T) * x.shape[1] * 2**-23 + 1e-30


def _check_against_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    exact = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    bound = _bound(x, weight) + (bias.double().abs() * 2**-23 if bias is not None else 0)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {(err / bound).max().item():.2f}x the bound"


# rows: tile remainders, one slice (128) and over it; K: under a chunk (16, 48), one chunk (128), a
# chunk and a remainder (144), two chunks and a remainder (272)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64, 100, 128, 129, 300])
@pytest.mark.parametrize("n,k", [(64, 16), (192, 48), (128, 128), (320, 144), (64, 272)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_and_onednn(avx512: bool, rows: int, n: int, k: int, bias: bool) -> None:
    _needs_avx512(avx512)
    x, weight, b = _problem(rows, n, k, bias, seed=rows * 1000 + n + k)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    got = torch.ops.pdserve_cpu.f32_linear(x, packed, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    _check_against_float64(got, x, weight, b)
    onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    assert ((got.double() - onednn.double()).abs() <= 2 * _bound(x, weight) + 1e-6).all()


def test_a_thread_count_that_does_not_divide_the_panels(avx512: bool) -> None:
    _needs_avx512(avx512)
    x, weight, b = _problem(40, 64 * 7, 96, True, seed=3)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            _check_against_float64(torch.ops.pdserve_cpu.f32_linear(x, packed, b), x, weight, b)
    finally:
        torch.set_num_threads(threads)


def test_no_rows(avx512: bool) -> None:
    _needs_avx512(avx512)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 32))
    assert torch.ops.pdserve_cpu.f32_linear(torch.empty(0, 32), packed, None).shape == (0, 64)


def test_bad_inputs_are_refused(avx512: bool) -> None:
    _needs_avx512(avx512)
    weight = torch.randn(64, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(4, 32)
    op = torch.ops.pdserve_cpu.f32_linear
    bad = [
        (x.bfloat16(), packed, None),  # not float32
        (torch.randn(4, 48), packed, None),  # K mismatch
        (torch.randn(4, 64)[:, ::2], packed, None),  # columns not contiguous
        (x, weight, None),  # a plain tensor, not oneDNN's packed one
        (x, packed, torch.randn(63)),  # bias of the wrong size
        (x, packed, torch.randn(64).bfloat16()),  # bf16 bias
        (torch.randn(4, 40), torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 40)), None),  # K padded
        (x, torch.ops.mkldnn._reorder_linear_weight(torch.randn(96, 32)), None),  # N not a multiple of 64
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            op(*args)


def test_linear_sends_decode_batches_to_the_kernel_and_prompts_to_onednn(avx512: bool) -> None:
    _needs_avx512(avx512)
    x, weight, b = _problem(F32_MAX_ROWS + 1, 128, 64, True, seed=5)
    lin = Linear(weight, b, prepack=True)
    assert lin.f32
    small, large = x[:F32_MAX_ROWS], x
    assert torch.equal(lin(small), torch.ops.pdserve_cpu.f32_linear(small, lin.packed, b))
    assert torch.equal(
        lin(large), torch.ops.mkldnn._linear_pointwise(large.contiguous(), lin.packed, b, "none", [], "")
    )


def test_linear_keeps_onednn_where_the_kernel_cannot_serve(avx512: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(64, 32)
    assert not Linear(torch.randn(96, 32), prepack=True).f32  # N not a multiple of 64
    assert not Linear(torch.randn(64, 40), prepack=True).f32  # K padded by oneDNN
    assert not Linear(weight.bfloat16(), prepack=True).f32  # bfloat16 model
    assert not Linear(weight).f32  # not prepacked
    monkeypatch.setenv("PDSERVE_F32_LINEAR", "0")
    assert not Linear(weight, prepack=True).f32
    monkeypatch.delenv("PDSERVE_F32_LINEAR")
    if avx512:
        assert Linear(weight, prepack=True).f32


def test_layout_check_is_bit_for_bit(avx512: bool) -> None:
    weight = torch.randn(128, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    if avx512:  # oneDNN's float32 layout there; another CPU's may differ, and then none is taken
        assert f32_layout(weight, packed)
    other = weight.clone()
    other[5, 9] += 1
    assert not f32_layout(other, packed)  # one value differs: not the layout (or not this weight)
    assert not f32_layout(weight.T.contiguous(), packed)
