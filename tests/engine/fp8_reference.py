"""Reference pieces for the FP8 GEMM path's tests (tests/engine/test_fp8_gemm.py,
test_fp8_loading.py, tests/gpu/test_cuda_fp8.py): the activation quantizer by its definition, a CPU
emulation of the block-scaled GEMM that first has torch's meta kernel check the operands, and the
tolerance against transformers with the check that applies it."""

from __future__ import annotations

import torch

from pdserve.engine import fp8
from pdserve.engine.fp8 import AMAX_EPS
from pdserve.engine.tiny_model import quantize_fp8

CUDA = torch.device("cuda")
REAL_BLOCK_SCALED_MM = fp8.block_scaled_mm
"""The real GEMM call, kept before any test replaces it by the emulation (which calls it on meta
tensors to have torch check the operands)."""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 weight as an FP8 checkpoint stores it (tiny_model.quantize_fp8, the writer the
    checkpoint tests use)."""
    q = quantize_fp8({"x_proj.weight": w})
    return q["x_proj.weight"], q["x_proj.weight_scale_inv"]


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one group at a time: scale = max(amax, eps) / 448; q = sat(x / scale)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, k // 128)
    for i in range(m):
        for j in range(k // 128):
            g = x[i, j * 128 : (j + 1) * 128].float()
            scale = torch.clamp(g.abs().max(), min=AMAX_EPS) / 448.0
            q[i, j * 128 : (j + 1) * 128] = torch.clamp(g / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
            s[i, j] = scale
    return q, s


def dequantize_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, dim=1)


def meta(t: torch.Tensor) -> torch.Tensor:
    """`t`'s shape, strides and dtype on the meta device: torch's checks of them, without data."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def emulated_block_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`fp8.block_scaled_mm` on CPU: first torch's meta kernel checks the operands exactly as they are
    laid out, then the product is computed as the block-scaled GEMM defines it, in float32: for each
    128-wide block of K, (x_q block @ w block.T) times the row's scale and the weight block's."""
    REAL_BLOCK_SCALED_MM(meta(x_q), meta(x_scale), meta(weight), meta(w_scale), out_dtype)
    m, k = x_q.shape
    n = weight.shape[0]
    w_blocks = w_scale.t()[:, : k // 128]  # [N/128, K/128]: the checkpoint's scales
    acc = torch.zeros(m, n)
    for j in range(k // 128):
        cols = slice(j * 128, (j + 1) * 128)
        partial = x_q[:, cols].float() @ weight[:, cols].float().t()  # exact: 128 products of 4+4-bit mantissas
        acc += partial * x_scale[:, j : j + 1] * w_blocks[:, j].repeat_interleave(128)[None, :n]
    return acc.to(out_dtype)


FP8_LOGPROB_ATOL = 0.3
"""How far a bfloat16 engine with FP8 GEMMs may put a chosen token's logprob from transformers' (in
bfloat16, on the hand-dequantized checkpoint, teacher-forced on the engine's tokens); a token other
than transformers' argmax is allowed only where its top-2 are within 2 * FP8_LOGPROB_ATOL (a near-tie).
The dense models' bfloat16 tolerance is 0.2 (tests/gpu/test_cuda_engine.py); FP8 activations
(1x128 groups, 3 mantissa bits) add rounding of their own. Measured with the emulated GEMM on
qwen3, llama and qwen2 tiny checkpoints (8 prompts x 12 tokens each): at most 0.18 (the dequantized
bfloat16 engine: at most 0.07), argmax flips only at top-2 gaps of at most 0.19.
tests/gpu/test_cuda_fp8.py holds the CUDA FP8 GEMM to the same bound."""


def assert_teacher_forced_close(outputs, prompts: list[list[int]], hf, device: str, atol: float) -> None:
    """Each greedy completion (logprobs >= 2) against `hf` run over prompt + completion at once."""
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        n = len(comp.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + comp.token_ids[:-1]], device=device)).logits[0, len(prompt) - 1 :]
        ref = torch.log_softmax(logits.float(), dim=-1).cpu()
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(n), torch.tensor(comp.token_ids)]
        assert torch.allclose(got, want, atol=atol), (got - want).abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        for i, t in enumerate(comp.token_ids):
            gap = (top2[i, 0] - top2[i, 1]).item()
            assert ref[i].argmax().item() == t or gap < 2 * atol, (i, t, gap)


def fp8_prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 1700 + 5 for j in range(5 + 11 * i)] for i in range(n)]
