"""Checkpoints of every served architecture from `make_tiny_model` (the same files `pdserve
make-tiny-model --arch` writes), FP8 block-quantized checkpoints, and the refusals at start of what
a config or a checkpoint asks for that pdserve does not implement (each names the key or tensor)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tiny_model import ARCHS, make_tiny_model
from tests.engine.factories import hf_greedy

NEW_TOKENS = 10


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1700) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def _assert_greedy_equals_hf(llm: LLM, hf_dir: Path, prompts: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, llm.generate(prompts, _params())):
        ids, ref = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == ids
        lp = ref[torch.arange(NEW_TOKENS), torch.tensor(ids)]
        got = torch.tensor([x.logprob for x in out.outputs[0].logprobs])
        assert torch.allclose(got, lp, atol=1e-4), (got - lp).abs().max()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_arch_is_a_real_hf_checkpoint(tmp_path, arch):
    """transformers loads what make_tiny_model writes, and pdserve's greedy output equals its own."""
    model_dir = make_tiny_model(tmp_path / arch, "tiny", arch=arch)
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == ARCHS[arch]["architectures"][0]
    assert (config.moe is not None) == (arch in ("qwen3-moe", "mixtral", "gpt-oss", "deepseek-v2", "deepseek-v3"))
    assert config.qk_norm == arch.startswith("qwen3")
    llm = LLM(model_dir, num_kv_blocks=128, block_size=8)
    try:
        _assert_greedy_equals_hf(llm, model_dir, _prompts(3, seed=1))
    finally:
        llm.close()


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint dequantized by hand (each 128x128 block of the float8 weight times its
    scale, written independently of pdserve's loader) as a plain float32 checkpoint."""
    out.mkdir()
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        if scale_name in tensors:
            w = t.float().clone()
            s = tensors[scale_name]
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= s[i, j]
            plain[name] = w
        else:
            plain[name] = t
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for f in fp8_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt-oss"])  # gpt-oss: MXFP4, test_mxfp4.py
def test_fp8_checkpoint_equals_its_hand_dequantized_copy(tmp_path, arch):
    fp8_dir = make_tiny_model(tmp_path / "fp8", "tiny", arch=arch, fp8=True)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert ModelConfig.from_dir(fp8_dir).fp8_block == (128, 128)
    llm = LLM(fp8_dir, num_kv_blocks=128, block_size=8)
    try:
        _assert_greedy_equals_hf(llm, _dequantized_copy(fp8_dir, tmp_path / "plain"), _prompts(3, seed=2))
    finally:
        llm.close()


BASE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize(
    "change, key",
    [
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"n_group": 4, "topk_group": 2}, "n_group"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 0}, "num_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "'gptq'"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "'mxfp4'"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "'compressed-tensors'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "weight_block_size": [128, 128],
                    "activation_scheme": "static",
                }
            },
            "activation_scheme",
        ),
    ],
)
def test_unserved_config_keys_are_refused_by_name(change, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[")):
        ModelConfig.from_dict({**BASE, **change})


def test_expert_keys_on_a_dense_architecture_are_refused():
    dense = {k: v for k, v in BASE.items() if k != "num_experts"}
    with pytest.raises(ValueError, match="num_local_experts"):
        ModelConfig.from_dict({**dense, "architectures": ["Qwen3ForCausalLM"], "num_local_experts": 8})


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = ModelConfig.from_dict({**BASE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    mixtral = ModelConfig.from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.moe.intermediate_size == 64


def _broken(tmp_path: Path, arch: str, fp8: bool, edit) -> Path:
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch=arch, fp8=fp8)
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


@pytest.mark.parametrize(
    "arch, fp8, edit, message",
    [
        (
            "qwen3-moe",
            False,
            lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
            "model.layers.1.mlp.experts.5.up_proj.weight",
        ),
        (
            "mixtral",
            False,
            lambda t: t.pop("model.layers.0.block_sparse_moe.experts.7.w2.weight"),
            "experts.7.w2.weight",
        ),
        (
            "qwen3-moe",
            False,
            lambda t: t.__setitem__("model.layers.0.mlp.shared_expert_gate.weight", torch.zeros(1, 128)),
            "shared_expert_gate",
        ),
        (
            "qwen3",
            True,
            lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(2, 2)),
            r"down_proj.weight_scale_inv has shape \(2, 2\)",
        ),
        (
            "qwen3",
            True,
            lambda t: t.pop("model.layers.2.self_attn.o_proj.weight_scale_inv"),
            "o_proj.weight is float8",
        ),
    ],
    ids=["missing-expert", "missing-mixtral-expert", "shared-expert-gate", "scale-shape", "scale-missing"],
)
def test_broken_checkpoints_are_refused_at_load(tmp_path, arch, fp8, edit, message):
    with pytest.raises(ValueError, match=message):
        LLM(_broken(tmp_path, arch, fp8, edit), num_kv_blocks=16)


def test_a_scale_without_fp8_config_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3", fp8=True)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(model_dir, num_kv_blocks=16)
