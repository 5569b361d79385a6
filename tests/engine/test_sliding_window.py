"""Mistral's sliding window (32 keys) against Hugging Face transformers, on prompts of 100+ tokens:
fresh prompts (SDPA), prefill chunks after a cached prefix (SDPA for long chunks, the kernel for short
ones), and decode tokens (the kernel), on both CPU backends; plus the kernel alone against a float64
reference."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kernels.cpu_build import load_paged_attention_op
from pdserve.engine.model_config import ModelConfig
from tests.engine.factories import build_checkpoint, hf_greedy

WINDOW = 32
NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4  # float32, as tests/engine/test_exactness.py


@pytest.fixture(scope="module")
def mistral(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = build_checkpoint("mistral", tmp_path_factory.mktemp("mistral"), tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    return model_dir, hf


def _prompts(seed: int, n: int, prefix: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [prefix + [rng.randrange(5, 1700) for _ in range(rng.randrange(100, 140) - len(prefix))] for _ in range(n)]


def test_the_window_is_read_from_the_config(mistral):
    model_dir, _ = mistral
    assert ModelConfig.from_dir(model_dir).sliding_window == WINDOW


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_greedy_matches_transformers_beyond_the_window(mistral, backend):
    model_dir, hf = mistral
    # 96-token steps: a 100+ token prompt is prefilled in two chunks, the second one after a
    # cached prefix; a shared 48-token prefix makes later prompts start from cached blocks
    llm = LLM(model_dir, num_kv_blocks=512, block_size=8, max_num_batched_tokens=96, attention_backend=backend)
    if backend == "cpu_paged":
        llm.engine.runner.attention.wait_ready()
        assert llm.engine.runner.attention.uses_kernel
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    prefix = [random.Random(3).randrange(5, 1700) for _ in range(48)]
    llm.generate(_prompts(0, 1, prefix), params)  # warm the prefix cache
    prompts = _prompts(1, 3, []) + _prompts(2, 3, prefix)
    outputs = llm.generate(prompts, params)
    assert all(o.num_cached_tokens >= 40 for o in outputs[3:])
    for prompt, out in zip(prompts, outputs):
        ids, ref = hf_greedy(hf, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ids
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(got, want, atol=LOGPROB_ATOL), (got - want).abs().max()
    llm.engine.check_integrity()


def test_the_window_changes_the_result(mistral):
    """Without the window the same weights give other logits: the test above can fail."""
    from transformers import AutoModelForCausalLM

    model_dir, hf = mistral
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, sliding_window=None).eval()
    ids = torch.tensor(_prompts(5, 1, []))
    with torch.no_grad():
        assert (hf(ids).logits[0, -1] - full(ids).logits[0, -1]).abs().max() > 1e-2


def test_qwen2_per_layer_windows_are_refused():
    raw = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        use_sliding_window=True,
        sliding_window=4,
    )
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "use_sliding_window": False}).sliding_window is None
    mistral = {**raw, "architectures": ["MistralForCausalLM"], "use_sliding_window": None}
    assert ModelConfig.from_dict(mistral).sliding_window == 4
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize("window", [1, 5, 16])
def test_kernel_window_matches_a_float64_reference(window):
    op = load_paged_attention_op()
    assert op is not None, "this machine has a C++ compiler: the op must build"
    gen = torch.Generator().manual_seed(window)
    hkv, hq, d, bs = 2, 4, 17, 4
    kv = torch.randn(16, 2, hkv, bs, d, generator=gen)
    tables = [[3, 7, 1, 9, 12], [0, 2], [5, 6, 8, 10, 11, 13]]
    q_lens, ctxs = [1, 3, 7], [19, 6, 23]  # a decode token, a short chunk, a chunk past the window
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    width = max(map(len, tables))
    table = i32([t + [0] * (width - len(t)) for t in tables])
    starts = i32([0, 1, 4, 11])
    out = op(q, kv, table, starts, i32(ctxs), 0.3, window)
    t = 0
    for tab, q_len, ctx in zip(tables, q_lens, ctxs):
        pos = torch.arange(ctx)
        blocks = torch.tensor(tab)[pos // bs]
        keys = kv[blocks, 0, :, pos % bs].double().repeat_interleave(hq // hkv, 1)
        values = kv[blocks, 1, :, pos % bs].double().repeat_interleave(hq // hkv, 1)
        for j in range(q_len):
            end = ctx - q_len + j + 1
            first = max(0, end - window)
            scores = torch.einsum("hd,khd->hk", q[t].double(), keys[first:end]) * 0.3
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first:end])
            torch.testing.assert_close(out[t].double(), want, atol=1e-5, rtol=1e-5)
            t += 1
