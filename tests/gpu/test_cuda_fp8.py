"""FP8 block-quantized checkpoints on CUDA (run with `pytest -m gpu` where a GPU is lent).

On compute capability 9.x (Hopper) in bfloat16 the dense projections run as FP8 GEMMs
(`engine.fp8.Fp8Linear`, `torch.nn.functional.scaled_mm` with 1x128 activation and 128x128 weight
scales). Asserted there:
- the GEMM itself: `Fp8Linear` on the card equals the block-scaled GEMM emulated in float32 on the
  same quantized operands (tests/engine/fp8_reference.py's emulation) within 2 bfloat16 ulps of
  the output's scale, for decode- and prefill-sized row counts;
- the engine: greedy completions of 8 prompts x 12 tokens, transformers (bfloat16, on the checkpoint
  dequantized by hand) teacher-forced on the engine's tokens: every chosen token's logprob within
  FP8_LOGPROB_ATOL = 0.3 of transformers', and every token transformers' argmax unless its top-2 are
  within 0.6 (a near-tie); see fp8_reference.FP8_LOGPROB_ATOL for how the bound was measured;
- PDSERVE_FP8_GEMM=0 dequantizes instead (no `Fp8Linear`).
Elsewhere (before Hopper, or Blackwell, where torch does not run this recipe) the checkpoint must be
dequantized at load, and its greedy tokens equal those of the same checkpoint with
PDSERVE_FP8_GEMM=0 (the same path, so identical).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.fp8 import Fp8Linear, fp8_gemm_supported, quantize_1x128, scale_a_layout, scale_b_layout
from pdserve.engine.tiny_model import make_tiny_model
from tests.engine.fp8_reference import (
    FP8_LOGPROB_ATOL,
    quantize_weight,
    assert_teacher_forced_close,
    emulated_block_scaled_mm,
    fp8_prompts,
)
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
requires_hopper = pytest.mark.skipif(not HOPPER, reason="FP8 GEMMs run on compute capability 9.x only")
NEW_TOKENS = 12


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, device="cuda", attention_backend="torch", num_kv_blocks=512, block_size=8, **kwargs)


def _fp8_linears(llm: LLM) -> list[bool]:
    return [isinstance(lin, Fp8Linear) for layer in llm.engine.runner.model.layers for lin in layer.linears()]


@requires_hopper
@pytest.mark.parametrize("n, k", [(512, 128), (128, 384), (768, 1024)])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_fp8_gemm_on_the_card_equals_the_emulated_gemm(n, k, rows):
    gen = torch.Generator().manual_seed(rows * n + k)
    w, w_scale = quantize_weight(torch.randn(n, k, generator=gen) * k**-0.5)
    lin = Fp8Linear(w.cuda(), w_scale.cuda(), torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = lin(x.cuda()).float().cpu()
    x_q, x_scale = quantize_1x128(torch.nn.functional.pad(x, (0, 0, 0, -rows % 4)))
    want = emulated_block_scaled_mm(x_q, scale_a_layout(x_scale), w, scale_b_layout(w_scale), torch.float32)[:rows]
    assert torch.allclose(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item()), (got - want).abs().max()


@requires_hopper
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3-moe"])
def test_fp8_gemms_track_the_dequantized_checkpoint(tmp_path, arch):
    """qwen2: the q/k/v bias after the FP8 GEMM; qwen3-moe: FP8 attention, dequantized experts."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_checkpoint_formats import _dequantized_copy

    model_dir = make_tiny_model(tmp_path / "fp8", "tiny", arch=arch, fp8=True)
    assert fp8_gemm_supported(torch.device("cuda"), torch.bfloat16)
    llm = _llm(model_dir, dtype="bfloat16")
    prompts = fp8_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    try:
        assert all(_fp8_linears(llm))
        outputs = llm.generate(prompts, params)
        llm.engine.check_integrity()
    finally:
        llm.close()
    hf_dir = _dequantized_copy(model_dir, tmp_path / "plain")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    assert_teacher_forced_close(outputs, prompts, hf, "cuda", FP8_LOGPROB_ATOL)


@requires_hopper
def test_forced_dequantization_on_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_FP8_GEMM", "0")
    llm = _llm(make_tiny_model(tmp_path / "fp8", "tiny", arch="qwen3", fp8=True), dtype="bfloat16")
    try:
        assert not any(_fp8_linears(llm))
    finally:
        llm.close()


@pytest.mark.skipif(HOPPER, reason="checks the dequantize path of GPUs without the FP8 GEMM")
def test_other_gpus_dequantize_at_load(tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "fp8", "tiny", arch="qwen3", fp8=True)
    assert not fp8_gemm_supported(torch.device("cuda"), torch.bfloat16)
    prompts = fp8_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = _llm(model_dir, dtype="bfloat16")
    try:
        assert not any(_fp8_linears(llm))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    monkeypatch.setenv("PDSERVE_FP8_GEMM", "0")
    llm = _llm(model_dir, dtype="bfloat16")
    try:
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
