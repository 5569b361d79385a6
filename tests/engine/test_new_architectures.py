"""Qwen3, Qwen3-MoE and Mixtral against Hugging Face transformers on random-weight checkpoints of odd
sizes (tests/engine/factories.py, NEW_KINDS).

float32: greedy ids identical and logprobs within 1e-4, on both CPU attention backends, in a batch
and after a cached prefix; also split over two tensor-parallel ranks (each expert split) and with
expert parallelism (whole experts per rank). bfloat16 and float16: transformers in the same dtype,
teacher-forced on the engine's output, logprobs within 0.2 and 0.05 (the dense models' tolerances,
tests/gpu).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.engine.factories import NEW_KINDS, assert_greedy_matches, build_checkpoint, hf_model, random_prompts

NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4
HALF_ATOL = {"bfloat16": 0.2, "float16": 0.05}
"""The dense models' tolerances (tests/gpu/test_cuda_engine.py)."""


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    made: dict[str, object] = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = build_checkpoint(kind, tmp_path_factory.mktemp(kind), tiny_model_dir)
        return made[kind]

    return get


def _hf(model_dir, dtype=torch.float32):
    return hf_model(model_dir, dtype)


def _prompts(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    return random_prompts(n, seed, prefix)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def _assert_matches(hf, llm: LLM, prompts: list[list[int]]) -> None:
    assert_greedy_matches(hf, llm, prompts, NEW_TOKENS, LOGPROB_ATOL)


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_greedy_matches_transformers(checkpoints, kind, backend):
    model_dir = checkpoints(kind)
    hf = _hf(model_dir)
    llm = LLM(model_dir, num_kv_blocks=512, block_size=8, max_num_batched_tokens=96, attention_backend=backend)
    try:
        if backend == "cpu_paged":
            llm.engine.runner.attention.wait_ready()
            assert llm.engine.runner.attention.uses_kernel
        _assert_matches(hf, llm, _prompts(6, seed=3))
        prefix = [random.Random(7).randrange(5, 1700) for _ in range(40)]
        prompts = _prompts(4, seed=4, prefix=prefix)
        llm.generate(prompts[:1], _params())  # warm the prefix cache; the next round must hit it
        outputs = llm.generate(prompts, _params())
        assert all(o.num_cached_tokens >= 32 for o in outputs)
        _assert_matches(hf, llm, prompts)
    finally:
        llm.close()


@pytest.mark.parametrize(
    "kind, expert_parallel",
    [("qwen3-moe-mixed", False), ("qwen3-moe-mixed", True), ("mixtral", True), ("qwen3", False)],
    ids=["qwen3-moe-tp2", "qwen3-moe-ep2", "mixtral-ep2", "qwen3-tp2"],
)
def test_two_ranks_match_transformers(checkpoints, kind, expert_parallel):
    """Each expert split over the two ranks, or whole experts on each (a range of them per rank)."""
    model_dir = checkpoints(kind)
    llm = LLM(
        model_dir,
        num_kv_blocks=256,
        block_size=8,
        max_num_batched_tokens=96,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    try:
        _assert_matches(_hf(model_dir), llm, _prompts(4, seed=5))
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe-mixed", "mixtral"])
def test_half_precision_within_tolerance(checkpoints, kind, dtype):
    model_dir = checkpoints(kind)
    hf = _hf(model_dir, getattr(torch, dtype))
    atol = HALF_ATOL[dtype]
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)
    try:
        prompts = _prompts(4, seed=6)
        for prompt, out in zip(prompts, llm.generate(prompts, _params())):
            comp = out.outputs[0]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + comp.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
            ref = torch.log_softmax(logits, dim=-1)
            got = torch.tensor([lp.logprob for lp in comp.logprobs])
            want = ref[torch.arange(NEW_TOKENS), torch.tensor(comp.token_ids)]
            assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
            top2 = ref.topk(2, dim=-1).values
            for i, t in enumerate(comp.token_ids):  # another pick only where transformers sees a near-tie
                assert ref[i].argmax().item() == t or (top2[i, 0] - top2[i, 1]).item() < 2 * atol
    finally:
        llm.close()


def test_every_token_on_one_expert_is_still_exact(tiny_model_dir, tmp_path):
    """A router that sends every token of every request to expert 0 (one channel of the residual
    stream held positive for every token; the router reads only that channel, positively for expert
    0 and negatively for the rest): one expert computes the whole batch, the others none."""
    from safetensors.torch import load_file, save_file

    model_dir = build_checkpoint("qwen3-moe", tmp_path, tiny_model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.embed_tokens.weight"][:, 0] = 4.0
    for name, t in tensors.items():  # nothing writes channel 0 back into the residual stream
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[0, :] = 0.0
        if name.endswith("mlp.gate.weight"):
            t.zero_()
            t[0, 0], t[1:, 0] = 10.0, -10.0
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model_dir, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)
    try:
        routed: list[torch.Tensor] = []
        for layer in llm.engine.runner.model.layers:
            assert layer.moe is not None
            route = layer.moe.route
            layer.moe.route = lambda h, route=route: routed.append(route(h)[1]) or route(h)  # type: ignore[method-assign]
        _assert_matches(_hf(model_dir), llm, _prompts(6, seed=8))
        assert routed and all(bool((ids[:, 0] == 0).all()) for ids in routed)
    finally:
        llm.close()
