"""FP8 checkpoints at load (engine/fp8.py, engine/weights.py), on CPU: (d) the load-time decision
(FP8 kept on compute capability 9.x in bf16/fp16, dequantized on CPU, pre-Hopper, Blackwell,
float32, or with PDSERVE_FP8_GEMM=0); (e) tensor-parallel slices of an FP8 weight and its scales
(slice then dequantize == dequantize then slice; a slice across a 128-block refused, naming the
tensor and the flag). Last, the engine end to end on CPU with the kept FP8 weights and the emulated
GEMM against the dequantized checkpoint, which measures what FP8 activations cost in greedy output
(the tolerance tests/gpu/test_cuda_fp8.py uses). The GEMM itself is in test_fp8_gemm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine import fp8
from pdserve.engine.fp8 import (
    Fp8Linear,
    dequantize_fp8_block,
    fp8_gemm_supported,
    fp8_gemm_unavailable,
    slice_fp8,
)
from pdserve.engine.layers import Linear
from pdserve.engine.llama import LlamaModel
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import TPShard
from pdserve.engine.tiny_model import FP8_CONFIG, _weights, make_tiny_model, quantize_fp8
from pdserve.engine.weights import load_tensors
from tests.engine.fp8_reference import (
    CUDA,
    FP8_LOGPROB_ATOL,
    assert_teacher_forced_close,
    emulated_block_scaled_mm,
    fp8_prompts,
    quantize_weight,
)


# (d) the decision at load


@pytest.mark.parametrize(
    "capability, dtype, kept",
    [
        ((8, 0), torch.bfloat16, False),  # Ampere: no FP8 tensor cores
        ((8, 9), torch.bfloat16, False),  # Ada: FP8, but torch's block-scaled recipe is SM90 only
        ((9, 0), torch.bfloat16, True),
        ((9, 0), torch.float16, True),
        ((9, 0), torch.float32, False),  # float32 runs dequantized
        ((10, 0), torch.bfloat16, False),  # Blackwell: torch raises NotImplementedError for this recipe
    ],
)
def test_fp8_gemm_decision_on_cuda_capabilities(monkeypatch, capability, dtype, kept):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv("PDSERVE_FP8_GEMM", raising=False)
    assert fp8_gemm_supported(CUDA, dtype) is kept
    assert (fp8_gemm_unavailable(CUDA, dtype) is None) is kept


def test_fp8_gemm_decision_off_cuda_and_when_forced_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not fp8_gemm_supported(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("PDSERVE_FP8_GEMM", "0")
    assert fp8_gemm_unavailable(CUDA, torch.bfloat16) == "PDSERVE_FP8_GEMM=0"


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_weights_follow_the_decision(monkeypatch, tmp_path, capability):
    """The loader and the model builder on the decision for a (mocked) CUDA device: kept FP8 with
    scales -> Fp8Linear for every dense projection; else dequantized `Linear`s, as on CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3", fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    keep = fp8_gemm_supported(CUDA, torch.bfloat16)
    # the tensors are placed on CPU (no card here); the decision is the one made for the CUDA device
    tensors = load_tensors(model_dir, cfg, (0, 4), torch.bfloat16, torch.device("cpu"), fp8_gemm=keep)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == (torch.float8_e4m3fn if keep else torch.bfloat16)
    assert ("model.layers.0.self_attn.q_proj.weight_scale_inv" in tensors) == keep
    model = LlamaModel(cfg, tensors, (0, 4), torch.device("cpu"))
    for layer in model.layers:
        assert all(isinstance(lin, Fp8Linear) == keep and isinstance(lin, Linear) for lin in layer.linears())
    assert model.lm_head is not None and not isinstance(model.lm_head, Fp8Linear)  # the head is not quantized


def test_cpu_default_dequantizes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3", fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    tensors = load_tensors(model_dir, cfg, (0, 4), torch.bfloat16, torch.device("cpu"))
    assert not any(t.dtype == torch.float8_e4m3fn or n.endswith("_scale_inv") for n, t in tensors.items())


def test_moe_experts_stay_dequantized_where_fp8_gemms_run(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3-moe", fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    tensors = load_tensors(model_dir, cfg, (0, 4), torch.bfloat16, torch.device("cpu"), fp8_gemm=True)
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    model = LlamaModel(cfg, tensors, (0, 4), torch.device("cpu"))
    layer = model.layers[0]
    assert layer.moe is not None and isinstance(layer.qkv, Fp8Linear)
    assert not any(isinstance(lin, Fp8Linear) for e in layer.moe.experts.values() for lin in (e.gate_up, e.down))


def test_unaligned_fused_weights_fall_back_to_dequantized(tmp_path):
    """A projection whose N is not a multiple of 128 (a 64-wide KV head) cannot stack its block
    scales with the others': that fused linear is dequantized, the aligned ones stay FP8."""
    w, s = quantize_weight(torch.randn(64, 128) * 0.1)
    q, qs = quantize_weight(torch.randn(128, 128) * 0.1)
    lin = fp8.fused_linear([q, w, w], [qs, s, s], torch.bfloat16)
    assert type(lin) is Linear and lin.weight is not None and lin.weight.dtype == torch.bfloat16
    want = torch.cat([dequantize_fp8_block(t, u, (128, 128), "w") for t, u in ((q, qs), (w, s), (w, s))])
    assert torch.equal(lin.weight, want.to(torch.bfloat16))
    assert isinstance(fp8.fused_linear([q, q], [qs, qs], torch.bfloat16), Fp8Linear)


# (e) tensor-parallel slices


@pytest.mark.parametrize("dim, start, stop", [(0, 0, 128), (0, 128, 320), (1, 256, 512), (1, 0, 384)])
def test_an_aligned_slice_dequantizes_like_the_slice_of_the_dequantized_weight(dim, start, stop):
    w, s = quantize_weight(torch.randn(320, 512, generator=torch.Generator().manual_seed(3)))
    ws, ss = slice_fp8(w, s, dim, start, stop, "w")
    whole = dequantize_fp8_block(w, s, (128, 128), "w").narrow(dim, start, stop - start)
    assert torch.equal(dequantize_fp8_block(ws, ss, (128, 128), "w"), whole)


@pytest.mark.parametrize("dim, start, stop", [(0, 64, 128), (0, 0, 192), (1, 0, 64)])
def test_a_slice_across_a_block_is_refused(dim, start, stop):
    w, s = quantize_weight(torch.randn(320, 512))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*--tensor-parallel-size"):
        slice_fp8(w, s, dim, start, stop, "model.layers.0.self_attn.k_proj.weight")


def _aligned_qwen3(tmp_path: Path) -> Path:
    """A qwen3 FP8 checkpoint whose projections split 2 ways on 128-multiples (4 KV heads of 64)."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 256,
        "torch_dtype": "float32",
        "quantization_config": dict(FP8_CONFIG),
    }
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(quantize_fp8(_weights(cfg, seed=0)), str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_loads_its_fp8_slice(tmp_path, rank):
    model_dir = _aligned_qwen3(tmp_path / "m")
    cfg = ModelConfig.from_dir(model_dir)
    shard = TPShard(rank, 2)
    kept = load_tensors(model_dir, cfg, (0, 2), torch.float32, torch.device("cpu"), shard, fp8_gemm=True)
    dense = load_tensors(model_dir, cfg, (0, 2), torch.float32, torch.device("cpu"), shard, fp8_gemm=False)
    names = [n for n in kept if n.endswith("_proj.weight")]
    assert len(names) == 2 * 7
    for name in names:
        assert kept[name].dtype == torch.float8_e4m3fn, name
        got = dequantize_fp8_block(kept[name], kept[name.removesuffix("weight") + "weight_scale_inv"], (128, 128), name)
        assert torch.equal(got, dense[name]), name


def test_tp_slice_off_the_blocks_is_refused_at_load(tmp_path):
    """The tiny qwen3's 2 KV heads of 64 split 2 ways give each rank 64 rows of k_proj."""
    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3", fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*--tensor-parallel-size.*PDSERVE_FP8_GEMM=0"):
        load_tensors(model_dir, cfg, (0, 4), torch.bfloat16, torch.device("cpu"), TPShard(0, 2), fp8_gemm=True)
    # dequantized (CPU, or PDSERVE_FP8_GEMM=0) the same split loads: whole weight dequantized, then sliced
    load_tensors(model_dir, cfg, (0, 4), torch.bfloat16, torch.device("cpu"), TPShard(0, 2), fp8_gemm=False)


# the engine end to end, FP8 weights kept, on the emulated GEMM


def test_engine_with_fp8_weights_matches_the_dequantized_checkpoint(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.engine.test_checkpoint_formats import _dequantized_copy

    model_dir = make_tiny_model(tmp_path / "m", "tiny", arch="qwen3", fp8=True)
    monkeypatch.setattr("pdserve.engine.weights.fp8_gemm_unavailable", lambda device, dtype: None)
    monkeypatch.setattr(fp8, "block_scaled_mm", emulated_block_scaled_mm)
    prompts = fp8_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=128, block_size=8)
    try:
        assert all(isinstance(lin, Fp8Linear) for lin in llm.engine.runner.model.layers[0].linears())
        outputs = llm.generate(prompts, params)
    finally:
        llm.close()
    hf_dir = _dequantized_copy(model_dir, tmp_path / "plain")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    assert_teacher_forced_close(outputs, prompts, hf, "cpu", FP8_LOGPROB_ATOL)
