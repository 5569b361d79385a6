"""gpt-oss's MXFP4 checkpoints: expert weights stored as FP4 (E2M1) codes with one power-of-two
exponent per 32 values, dequantized at load (engine.mxfp4).

The dequantization equals transformers' own (`convert_moe_packed_tensors`) bit for bit, for every
code and exponent, in float32 and bfloat16; a tiny MXFP4 checkpoint (the gpt-oss factory's weights
quantized here by the format's inverse) loads to exactly transformers' dequantized weights and greedy
decodes token for token as transformers does loading it (dequantized on CPU); malformed ones are
refused by name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.mxfp4 import E2M1_VALUES, dequantize
from pdserve.engine.weights import load_tensors
from tests.engine.factories import build_checkpoint, hf_greedy

QUANTIZED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
"""openai/gpt-oss's `quantization_config`: everything but the experts stays bf16."""


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, R, C] -> (blocks uint8 [E, R, C/32, 16], scales uint8 [E, R, C/32]): per 32 values the
    smallest power of two that brings their largest magnitude within E2M1's 6, then each value's
    nearest code, two codes a byte, the even value in the low nibble."""
    e, r, c = w.shape
    blocks = w.float().reshape(e, r, c // 32, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1_VALUES)).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dir(tiny_model_dir, tmp_path_factory):
    src = build_checkpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss"), tiny_model_dir)
    return to_mxfp4(src, tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def to_mxfp4(src: Path, dst: Path) -> Path:
    """gpt-oss checkpoint `src` copied to `dst` with its experts in MXFP4, as openai/gpt-oss ships
    them: each [E, in, out] weight quantized along `in` as its transpose [E, out, in]."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.endswith(QUANTIZED):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(w.transpose(1, 2))
        else:
            tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, quantization_config=MXFP4_CONFIG)))
    return dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_and_exponent_dequantizes_as_transformers_does(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).repeat(24).view(2, 3, 64, 16)  # every byte, 24 times
    scales = (torch.arange(2 * 3 * 64) * 7 % 256).to(torch.uint8).view(2, 3, 64)  # every exponent 0..255
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    got = dequantize(blocks, scales, dtype)
    assert got.dtype == dtype and got.shape == want.shape == (2, 64 * 32, 3)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


def test_the_quantizer_is_the_formats_inverse():
    """Values already on the grid (an E2M1 value times a power of two per block) come back exactly."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2, 8, 64), generator=g)
    exps = torch.randint(-6, 6, (2, 8, 2), generator=g).repeat_interleave(32, dim=-1)
    w = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(exps.float())
    w[..., ::32] = 6.0 * torch.exp2(exps[..., ::32].float())  # each block's largest value sets its exponent
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(dequantize(blocks, scales, torch.float32).transpose(1, 2), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_dequantizes_to_transformers_weights(mxfp4_dir, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = ModelConfig.from_dir(mxfp4_dir)
    assert cfg.mxfp4 and cfg.fp8_block is None
    raw = load_file(str(mxfp4_dir / "model.safetensors"))
    loaded = load_tensors(mxfp4_dir, cfg, (0, cfg.num_hidden_layers), dtype, torch.device("cpu"))
    for i in range(cfg.num_hidden_layers):
        for part in QUANTIZED:
            name = f"model.layers.{i}.{part}"
            want = convert_moe_packed_tensors(raw[name + "_blocks"], raw[name + "_scales"], dtype=dtype)
            assert torch.equal(loaded[name], want), name
            assert name + "_blocks" not in loaded and name + "_scales" not in loaded


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_greedy_matches_transformers_loading_the_mxfp4_checkpoint(mxfp4_dir, backend):
    """transformers dequantizes MXFP4 at load on CPU (`Mxfp4Config(dequantize=True)`): the same
    weights, so the same tokens and logprobs within 1e-4 in float32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 1700) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    llm = LLM(mxfp4_dir, num_kv_blocks=256, block_size=8, max_num_batched_tokens=96, attention_backend=backend)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            ids, ref = hf_greedy(hf, prompt, 10)
            comp = out.outputs[0]
            assert comp.token_ids == ids
            got = torch.tensor([lp.logprob for lp in comp.logprobs])
            assert torch.allclose(got, ref[torch.arange(10), torch.tensor(ids)], atol=1e-4)
    finally:
        llm.close()


def test_malformed_mxfp4_is_refused_by_name(mxfp4_dir, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=f"{name}: MXFP4 blocks .* and scales .* do not match"):
        dequantize(
            torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8), torch.float32, name
        )
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, dtype=torch.uint8), torch.float32)
    plain = tmp_path / "no-config"  # quantized tensors, but config.json does not say so: nothing to read them as
    shutil.copytree(mxfp4_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks tensors: .*mlp\.experts\.gate_up_proj"):
        LLM(plain, num_kv_blocks=64, block_size=8)
