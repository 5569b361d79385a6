"""`pdserve_cpu.amx_linear` (csrc/cpu_amx_linear.cpp) and `Linear`'s use of it for decode-sized bf16
batches: against a float64 reference and oneDNN's result on the same packed weight, every row-tile
remainder (1-15 rows over a multiple of 16, an odd number of tiles), bias, row-strided inputs and bad
inputs. Needs a CPU with AMX; the dispatch tests also hold where it has none (the op is never used).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_build
from pdserve.engine.layers import AMX_MAX_ROWS, Linear, amx_layout, bf16_via_float32


@pytest.fixture(scope="module")
def amx() -> bool:
    assert cpu_build.load_paged_attention_op() is not None, "this machine has a C++ compiler: the ops must build"
    return bool(torch.ops.pdserve_cpu.amx_available())


def _needs_amx(amx: bool) -> None:
    if not amx:
        pytest.skip("this CPU (or kernel) has no AMX bf16 tiles")


def _problem(rows: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k + 48, generator=g).bfloat16()[:, 7 : 7 + k]  # rows apart in memory, as slices are
    return x, weight, b


def _check_against_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    exact = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    # one bf16 rounding of the float32 sum, plus float32 summation error over K terms
    bound = exact.abs() * 2**-8 + (x.double().abs() @ weight.double().abs().T) * x.shape[1] * 2**-24 + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {(err / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 100, 128, 300, 700])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (64, 288), (256, 768)])  # K: 1, 2, 8 + 1 and 3 x 8 blocks of 32
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_and_onednn(amx: bool, rows: int, n: int, k: int, bias: bool) -> None:
    _needs_amx(amx)
    x, weight, b = _problem(rows, n, k, bias, seed=rows * 1000 + n + k)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    got = torch.ops.pdserve_cpu.amx_linear(x, packed, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _check_against_float64(got, x, weight, b)
    onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    differ = got != onednn
    assert differ.float().mean() < 0.05, "more than summation-order ties differ from oneDNN"
    # where they differ: a bf16 step of either, or both float32 sums' error where terms cancel
    terms = (x.double().abs() @ weight.double().abs().T) * k * 2**-23
    step = torch.maximum(got.double().abs(), onednn.double().abs()) * 2**-7 + terms
    assert ((got.double() - onednn.double()).abs() <= step).all()


def test_a_thread_count_that_does_not_divide_the_column_blocks(amx: bool) -> None:
    _needs_amx(amx)
    x, weight, b = _problem(40, 32 * 7, 96, True, seed=3)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            _check_against_float64(torch.ops.pdserve_cpu.amx_linear(x, packed, b), x, weight, b)
    finally:
        torch.set_num_threads(threads)


def test_no_rows(amx: bool) -> None:
    _needs_amx(amx)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 32).bfloat16())
    assert torch.ops.pdserve_cpu.amx_linear(torch.empty(0, 32, dtype=torch.bfloat16), packed, None).shape == (0, 64)


def test_bad_inputs_are_refused(amx: bool) -> None:
    _needs_amx(amx)
    weight = torch.randn(64, 32).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(4, 32).bfloat16()
    op = torch.ops.pdserve_cpu.amx_linear
    bad = [
        (x.float(), packed, None),  # not bf16
        (torch.randn(4, 48).bfloat16(), packed, None),  # K mismatch
        (torch.randn(4, 64).bfloat16()[:, ::2], packed, None),  # columns not contiguous
        (x, weight, None),  # a plain tensor, not oneDNN's packed one
        (x, packed, torch.randn(63).bfloat16()),  # bias of the wrong size
        (x, packed, torch.randn(64)),  # float32 bias
        (torch.randn(4, 40).bfloat16(), torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 40).bfloat16()), None),
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            op(*args)


def test_linear_sends_decode_batches_to_amx_and_prompts_to_onednn(amx: bool) -> None:
    _needs_amx(amx)
    x, weight, b = _problem(AMX_MAX_ROWS + 1, 96, 64, True, seed=5)
    lin = Linear(weight, b, prepack=True)
    assert lin.amx
    small, large = x[:AMX_MAX_ROWS], x
    assert torch.equal(lin(small), torch.ops.pdserve_cpu.amx_linear(small, lin.packed, b))
    assert torch.equal(
        lin(large), torch.ops.mkldnn._linear_pointwise(large.contiguous(), lin.packed, b, "none", [], "")
    )


def test_linear_keeps_onednn_where_amx_cannot_serve(amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(64, 32).bfloat16()
    assert not Linear(torch.randn(40, 32).bfloat16(), prepack=True).amx  # N not a multiple of 32
    assert not Linear(torch.randn(64, 40).bfloat16(), prepack=True).amx  # K not a multiple of 32
    assert not Linear(weight.float(), prepack=True).amx  # float32 model
    assert not Linear(weight).amx  # not prepacked
    monkeypatch.setenv("PDSERVE_AMX_LINEAR", "0")
    assert not Linear(weight, prepack=True).amx
    monkeypatch.delenv("PDSERVE_AMX_LINEAR")
    if amx:  # elsewhere it may still be eligible (the CPU has AMX, the kernel refused it): calls stay on oneDNN
        assert Linear(weight, prepack=True).amx


def test_layout_check_is_bit_for_bit() -> None:
    if bf16_via_float32():
        pytest.skip("oneDNN has no bf16 kernels on this CPU: bf16 weights are packed as float32")
    weight = torch.randn(64, 64).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    other = weight.clone()
    other[5, 9] += 1
    assert not amx_layout(other, packed)  # one value differs: not the layout (or not this weight)
    assert not amx_layout(weight.T.contiguous(), packed)
