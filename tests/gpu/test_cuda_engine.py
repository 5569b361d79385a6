"""The engine on CUDA equals Hugging Face transformers, and the flashinfer backend equals the torch one.

float32: greedy tokens identical and logprobs within 1e-3. float16/bfloat16: transformers is run in
the same dtype and teacher-forced on the engine's output, so a near-tie that flips one token does not
hide a real error; the chosen tokens' logprobs must agree within a per-dtype tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.gpu.helpers import assert_greedy_close, flashinfer_or_skip, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
NEW_TOKENS = 16
TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.2}


def _prompts(n: int, seed: int, prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 1700) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, 1700) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = (
                AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
            )
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_engine_on_cuda_matches_transformers(tiny_model_dir, hf_models, dtype):
    hf = hf_models(dtype)
    llm = LLM(
        tiny_model_dir,
        device="cuda",
        dtype=dtype,
        attention_backend="torch",
        num_kv_blocks=512,
        block_size=8,
        max_num_batched_tokens=128,
    )
    assert llm.engine.runner.kv_pool.tensor.is_cuda
    prompts = _prompts(8, seed=1) + _prompts(4, seed=2, prefix_len=40)
    outputs = llm.generate(prompts, _params())
    atol = TOLERANCE[dtype]
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        seq = torch.tensor([prompt + comp.token_ids[:-1]], device="cuda")
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1 :].float()
        ref = torch.log_softmax(logits, dim=-1)
        got = torch.tensor([lp.logprob for lp in comp.logprobs], device="cuda")
        want = ref[torch.arange(NEW_TOKENS, device="cuda"), torch.tensor(comp.token_ids, device="cuda")]
        assert torch.allclose(got, want, atol=atol), (dtype, (got - want).abs().max().item())
        if dtype == "float32":  # token-exact: the engine's pick is transformers' argmax at every step
            assert comp.token_ids == ref.argmax(-1).tolist()
        else:  # a different pick only where transformers itself sees a near-tie
            top2 = ref.topk(2, dim=-1).values
            for i, t in enumerate(comp.token_ids):
                assert ref[i].argmax().item() == t or (top2[i, 0] - top2[i, 1]).item() < 2 * atol, (i, dtype)
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flashinfer_backend_matches_torch_backend(dtype):
    """On the `bench` model (head_dim 64, GQA 3:1): flashinfer's kernels cover that head size."""
    flashinfer_or_skip()
    from pdserve.engine.builtin import default_model_dir

    model = default_model_dir("bench")
    kwargs = dict(device="cuda", dtype=dtype, num_kv_blocks=512, block_size=16, max_num_batched_tokens=128)
    ref = LLM(model, attention_backend="torch", **kwargs)
    fi = LLM(model, attention_backend="flashinfer", **kwargs)
    assert fi.engine.runner.attention.__class__.__name__ == "FlashInferAttention"
    # mixed lengths, a shared prefix (paged prefill over cached pages) and chunked long prompts
    prompts = _prompts(8, seed=3) + _prompts(4, seed=4, prefix_len=48) + _prompts(2, seed=5, prefix_len=200)
    for round_ in range(2):  # round 1 hits the prefix cache
        expected = ref.generate(prompts, _params())
        got = fi.generate(prompts, _params())
        compared = [assert_greedy_close(e.outputs[0], g.outputs[0], TOLERANCE[dtype]) for e, g in zip(expected, got)]
        assert sum(compared) >= len(prompts) * NEW_TOKENS // 2, compared
    fi.engine.check_integrity()


def test_sampled_requests_run_on_cuda_and_a_seed_reproduces_them(tiny_model_dir):
    """Logits stay on the GPU while each request's generator is a CPU one: a sampled (temperature > 0)
    request must still draw, and the same seed must give the same tokens again."""
    prompts = _prompts(3, seed=21)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
    on_gpu = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=256)
    first = [o.outputs[0].token_ids for o in on_gpu.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in on_gpu.generate(prompts, params)]
    assert first == again and all(len(t) == NEW_TOKENS for t in first)
    assert len({tok for t in first for tok in t}) > 3  # it sampled, not a constant
