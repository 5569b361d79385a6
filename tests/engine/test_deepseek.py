"""DeepSeek-V2 and V3 (latent attention, grouped MoE routing, shared experts) against Hugging Face
transformers on random-weight checkpoints saved by transformers itself, odd sizes.

float32: greedy ids identical and logprobs within 1e-4 on both CPU attention backends, in a batch
and after a cached prefix, and over two tensor-parallel ranks (heads split, the latent whole on
each; experts split or whole); bfloat16 and float16 teacher-forced within the other models'
tolerances. Also: the pool holds the latent once
(one plane of kv_lora_rank + qk_rope_head_dim values), and bad configs are refused by key.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_config import ModelConfig
from tests.engine.factories import assert_greedy_matches, hf_model, random_prompts

NEW_TOKENS = 10
LOGPROB_ATOL = 1e-4
COMMON = dict(
    vocab_size=2048,
    hidden_size=96,
    intermediate_size=160,
    moe_intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=6,
    kv_lora_rank=40,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=20,
    n_routed_experts=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
)
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=0.8,
    rope_theta=10000.0,
)
KINDS = {
    # V2-Lite's layout: no q LoRA, softmax routing limited to the best groups, two shared experts
    "v2": dict(q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2),
    "v2-greedy-yarn": dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=1, rope_scaling=YARN),
    # V3: q LoRA, sigmoid scores with a correction bias, renormalised and scaled weights
    "v3": dict(
        q_lora_rank=36, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5
    ),
    "v3-yarn-flat-rope": dict(
        q_lora_rank=36, n_group=2, topk_group=1, n_shared_experts=1, rope_interleave=False, rope_scaling=YARN
    ),
}


def build_deepseek(kind: str, out_dir: Path, tokenizer_src: Path) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    spec = dict(COMMON, **KINDS[kind])
    v3 = kind.startswith("v3")
    cfg = DeepseekV3Config(**spec) if v3 else DeepseekV2Config(**spec)
    torch.manual_seed(4321)
    model = (DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM)(cfg).to(torch.float32)
    with torch.no_grad():  # sharper logits and routing than the default init; norms not all ones
        model.lm_head.weight.normal_(0.0, 0.3)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
            if attn.q_a_layernorm is not None:
                attn.q_a_layernorm.weight.uniform_(0.5, 1.5)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.5)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_deepseek(kind, tmp_path_factory.mktemp(kind), tiny_model_dir)
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
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_matches_transformers(checkpoints, kind, backend):
    model_dir = checkpoints(kind)
    hf = _hf(model_dir)
    llm = LLM(model_dir, num_kv_blocks=512, block_size=8, max_num_batched_tokens=96, attention_backend=backend)
    try:
        if backend == "cpu_paged":
            llm.engine.runner.attention.wait_ready()
            assert llm.engine.runner.attention.uses_kernel
        _assert_matches(hf, llm, _prompts(5, seed=3))
        prefix = [random.Random(7).randrange(5, 1700) for _ in range(40)]
        prompts = _prompts(3, seed=4, prefix=prefix)
        llm.generate(prompts[:1], _params())  # warm the prefix cache; the next round must hit it
        outputs = llm.generate(prompts, _params())
        assert all(o.num_cached_tokens >= 32 for o in outputs)
        _assert_matches(hf, llm, prompts)
    finally:
        llm.close()


def test_pool_holds_the_latent_once(checkpoints):
    """One plane of kv_lora_rank + qk_rope_head_dim values per token and layer: no expanded K/V."""
    llm = LLM(checkpoints("v3"), num_kv_blocks=64, block_size=8)
    try:
        pool = llm.engine.runner.kv_pool
        latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
        assert tuple(pool.tensor.shape) == (COMMON["num_hidden_layers"], 64, 1, 1, 8, latent)
        assert pool.block_bytes == 8 * latent * pool.tensor.element_size()
    finally:
        llm.close()


@pytest.mark.parametrize("kind, expert_parallel", [("v2", False), ("v3", False), ("v3", True)])
def test_two_ranks_match_transformers(checkpoints, kind, expert_parallel):
    """Heads (q, kv_b_proj, o_proj) and the shared expert split over two ranks, the routed experts
    split too or placed whole (expert parallelism); each rank caches the whole latent."""
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
        _assert_matches(_hf(model_dir), llm, _prompts(3, seed=5))
    finally:
        llm.close()


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0.2), ("float16", 0.05)])
def test_half_precision_within_tolerance(checkpoints, dtype, atol):
    """The dense models' tolerances (tests/gpu/test_cuda_engine.py), transformers in the same dtype."""
    model_dir = checkpoints("v3")
    hf = _hf(model_dir, getattr(torch, dtype))
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96)
    try:
        prompts = _prompts(3, seed=6)
        for prompt, out in zip(prompts, llm.generate(prompts, _params())):
            comp = out.outputs[0]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + comp.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
            ref = torch.log_softmax(logits, dim=-1)
            got = torch.tensor([lp.logprob for lp in comp.logprobs])
            want = ref[torch.arange(NEW_TOKENS), torch.tensor(comp.token_ids)]
            assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    finally:
        llm.close()


def test_mtp_layers_are_skipped_with_one_log_line(checkpoints, tmp_path, caplog):
    """A V3 checkpoint's multi-token-prediction layer (index num_hidden_layers) is not a decoder layer."""
    from safetensors.torch import load_file, save_file

    src = checkpoints("v3")
    model_dir = tmp_path / "mtp"
    shutil.copytree(src, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    last = COMMON["num_hidden_layers"]
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("model.layers.2.", f"model.layers.{last}.")] = tensors[name].clone()
    tensors[f"model.layers.{last}.eh_proj.weight"] = torch.zeros(96, 192)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("INFO", logger="pdserve.engine.weights"):
        llm = LLM(model_dir, num_kv_blocks=64, block_size=8)
    try:
        assert len(llm.engine.runner.model.layers) == last
        skipped = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
        assert len(skipped) == 1 and f"[{last}]" in skipped[0].getMessage()
        _assert_matches(_hf(src), llm, _prompts(2, seed=9))
    finally:
        llm.close()


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(topk_method="device_limited"), "topk_method"),
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(scoring_func="sigmoid", topk_method="greedy"), "topk_method"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(n_group=3), "n_group"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
    ],
)
def test_bad_configs_are_refused_by_key(checkpoints, change, key):
    raw = json.loads((checkpoints("v2") / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(raw)


def test_latent_width_that_does_not_match_the_weights_is_refused(checkpoints, tmp_path):
    model_dir = tmp_path / "wrong"
    shutil.copytree(checkpoints("v2"), model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["kv_lora_rank"] = 32  # the weights hold 40
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="kv_a_proj_with_mqa"):
        LLM(model_dir, num_kv_blocks=64, block_size=8)
