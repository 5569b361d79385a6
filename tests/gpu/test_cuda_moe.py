"""The mixture-of-experts and FP8 paths on CUDA against transformers (run with `pytest -m gpu` where a
GPU is lent).

bfloat16 on a device of compute capability 9.0+ takes the grouped GEMM path (`torch._grouped_mm`,
engine/moe.py); elsewhere, and in float32, the grouped loop the CPU runs. float32: greedy tokens
identical to transformers; bfloat16: transformers teacher-forced on the engine's output, logprobs
within the dense models' tolerance (tests/gpu/test_cuda_engine.py). An FP8 checkpoint, dequantized
at load, equals its hand-dequantized float32 copy on transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tiny_model import make_tiny_model
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
NEW_TOKENS = 12
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.2}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1700) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def _check(llm: LLM, hf_dir, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    prompts = _prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    atol = TOLERANCE[dtype]
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        comp = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + comp.token_ids[:-1]], device="cuda")).logits[0, len(prompt) - 1 :]
        ref = torch.log_softmax(logits.float(), dim=-1).cpu()
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(NEW_TOKENS), torch.tensor(comp.token_ids)]
        assert torch.allclose(got, want, atol=atol), (dtype, (got - want).abs().max().item())
        top2 = ref.topk(2, dim=-1).values
        for i, t in enumerate(comp.token_ids):
            assert ref[i].argmax().item() == t or (dtype != "float32" and (top2[i, 0] - top2[i, 1]).item() < 2 * atol)
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_moe_on_cuda_matches_transformers(tmp_path, arch, dtype):
    model_dir = make_tiny_model(tmp_path / arch, "tiny", arch=arch)
    llm = LLM(model_dir, device="cuda", dtype=dtype, attention_backend="torch", num_kv_blocks=512, block_size=8)
    grouped = dtype == "bfloat16" and torch.cuda.get_device_capability() >= (9, 0) and hasattr(torch, "_grouped_mm")
    layer = llm.engine.runner.model.layers[0]
    assert layer.moe is not None
    _check(llm, model_dir, dtype)
    assert (layer.moe._stacked is not None) == grouped  # the grouped GEMM path ran where it can
    llm.close()


def test_fp8_checkpoint_on_cuda_equals_its_dequantized_copy(tmp_path):
    from tests.engine.test_checkpoint_formats import _dequantized_copy

    fp8_dir = make_tiny_model(tmp_path / "fp8", "tiny", arch="qwen3-moe", fp8=True)
    llm = LLM(fp8_dir, device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=512, block_size=8)
    _check(llm, _dequantized_copy(fp8_dir, tmp_path / "plain"), "float32")
    llm.close()
