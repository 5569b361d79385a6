"""Greedy ids and logprobs of pdserve's engine equal Hugging Face transformers on the same weights.

Tolerance: logprobs within 1e-4 (float32; observed differences are ~1e-6, from
fused q/k/v and gate/up matmuls and a different attention kernel). Some cases also run at
tensor-parallel size 2 (engine.parallel, two gloo ranks): the built-in model, a GQA model whose
two KV heads are split, and an MQA model whose one KV head is replicated on both ranks.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine.factories import build_checkpoint, hf_greedy

CASES = ["builtin", "gqa", "qwen2", "llama3"]
NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4


BACKENDS = ["torch", "cpu_paged"]
TP_CASES = [("builtin", "cpu_paged", 2), ("gqa", "torch", 2), ("mqa", "cpu_paged", 2)]
"""(kind, backend, tensor_parallel_size): a few, since each starts a second rank process."""


@pytest.fixture(
    scope="module",
    params=[(c, b, 1) for c in CASES for b in BACKENDS] + TP_CASES,
    ids=lambda p: f"{p[0]}-{p[1]}" + (f"-tp{p[2]}" if p[2] > 1 else ""),
)
def case(request, tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    kind, backend, tp = request.param
    if kind == "builtin":
        model_dir = tiny_model_dir
    else:
        model_dir = build_checkpoint(kind, tmp_path_factory.mktemp(kind), tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(
        model_dir,
        num_kv_blocks=512,
        block_size=8,
        max_num_batched_tokens=96,
        attention_backend=backend,
        tensor_parallel_size=tp,
    )
    if backend == "cpu_paged":  # this machine has a compiler: the kernel must be what is tested
        llm.engine.runner.attention.wait_ready()
        assert llm.engine.runner.attention.uses_kernel
    yield hf, llm
    llm.close()


def _prompts(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 1700) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_greedy_matches_transformers(case, batch, shared_prefix):
    hf, llm = case
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    prefix = [random.Random(7).randrange(5, 1700) for _ in range(40)] if shared_prefix else None
    prompts = _prompts(batch, seed=batch, prefix=prefix)
    if shared_prefix:  # warm the prefix cache, then the measured round must hit it
        llm.generate(prompts[:1], params)
    outputs = llm.generate(prompts, params)
    if shared_prefix:
        assert all(o.num_cached_tokens >= 32 for o in outputs), [o.num_cached_tokens for o in outputs]
    for prompt, out in zip(prompts, outputs):
        ids, ref_lp = hf_greedy(hf, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ids
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref_lp[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(got, want, atol=LOGPROB_ATOL), (got - want).abs().max()
        assert [t for t, _ in comp.logprobs[0].top] == ref_lp[0].topk(2).indices.tolist()
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
