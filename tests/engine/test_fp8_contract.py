"""The FP8 GEMM path (engine/fp8.py) held to its contract on CPU, where no FP8 GEMM can run: what a
torch upgrade or a layout mistake would break fails here, not first on a Hopper GPU.

(a) the 1x128 activation quantizer equals a plain per-group reference and round-trips within e4m3
precision; (b) a CPU emulation of the block-scaled GEMM (per 128-wide K block: an exact float32
product of the FP8 values, times the row's and the weight block's scales, summed) equals
dequantize(x_q) @ dequantize(w).T and is close to the unquantized product; (c) `F.scaled_mm`, the
`ScalingType` members and the aten op exist as called, and the operands `Fp8Linear` builds pass
torch's own checks of `_scaled_mm_v2` (its meta kernel, which applies the CUDA layout rules: row-major
A, column-major B, M-major 1x128 scales, [L4, N/128] 128x128 scales); (d) the load-time decision
(FP8 kept on compute capability 9.x in bf16/fp16, dequantized on CPU, pre-Hopper, Blackwell,
float32, or with PDSERVE_FP8_GEMM=0); (e) tensor-parallel slices of an FP8 weight and its scales
(slice then dequantize == dequantize then slice; a slice across a 128-block refused, naming the
tensor and the flag). Last, the engine end to end on CPU with the kept FP8 weights and the emulated
GEMM against the dequantized checkpoint, which measures what FP8 activations cost in greedy output
(the tolerance tests/gpu/test_cuda_fp8.py uses).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine import fp8
from pdserve.engine.fp8 import (
    AMAX_EPS,
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8_block,
    fp8_gemm_supported,
    fp8_gemm_unavailable,
    quantize_1x128,
    scale_a_layout,
    scale_b_layout,
    slice_fp8,
)
from pdserve.engine.layers import Linear
from pdserve.engine.llama import LlamaModel
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import TPShard
from pdserve.engine.tiny_model import FP8_CONFIG, _weights, make_tiny_model, quantize_fp8
from pdserve.engine.weights import load_tensors

CUDA = torch.device("cuda")
REAL_BLOCK_SCALED_MM = fp8.block_scaled_mm
"""The real GEMM call, kept before any test replaces it by the emulation (which calls it on meta
tensors to have torch check the operands)."""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 weight as an FP8 checkpoint stores it (tiny_model.quantize_fp8, the writer the
    checkpoint tests use)."""
    q = quantize_fp8({"x_proj.weight": w})
    return q["x_proj.weight"], q["x_proj.weight_scale_inv"]


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _dequantize_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, dim=1)


def _meta(t: torch.Tensor) -> torch.Tensor:
    """`t`'s shape, strides and dtype on the meta device: torch's checks of them, without data."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def emulated_block_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`fp8.block_scaled_mm` on CPU: first torch's meta kernel checks the operands exactly as they are
    laid out, then the product is computed as the block-scaled GEMM defines it, in float32: for each
    128-wide block of K, (x_q block @ w block.T) times the row's scale and the weight block's."""
    REAL_BLOCK_SCALED_MM(_meta(x_q), _meta(x_scale), _meta(weight), _meta(w_scale), out_dtype)
    m, k = x_q.shape
    n = weight.shape[0]
    w_blocks = w_scale.t()[:, : k // 128]  # [N/128, K/128]: the checkpoint's scales
    acc = torch.zeros(m, n)
    for j in range(k // 128):
        cols = slice(j * 128, (j + 1) * 128)
        partial = x_q[:, cols].float() @ weight[:, cols].float().t()  # exact: 128 products of 4+4-bit mantissas
        acc += partial * x_scale[:, j : j + 1] * w_blocks[:, j].repeat_interleave(128)[None, :n]
    return acc.to(out_dtype)


# (a) the activation quantizer


def test_quantizer_equals_the_reference_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 384, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 128:256] = 0.0  # an all-zero group: amax clamped to eps, values quantize to 0
    x[3, :128] *= 1e-12  # a group below the eps floor
    x = x.to(torch.bfloat16)
    q, s = quantize_1x128(x)
    rq, rs = _reference_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 384) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (7, 3)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    assert s[2, 1].item() == pytest.approx(AMAX_EPS / FP8_MAX) and not q[2, 128:256].float().any()
    # each group's largest magnitude lands on +-448 (saturated, never NaN)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((7,), 448.0))


def test_quantizer_round_trips_within_e4m3_precision():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 256, generator=gen) * 5
    q, s = quantize_1x128(x)
    back = _dequantize_act(q, s)
    scale = s.repeat_interleave(128, dim=1)
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormals in steps of 2^-9 (half-step 2^-10)
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back - x).abs().max() > 0  # lossy: the tests below would not notice a no-op quantizer


def test_quantizer_refuses_a_width_off_the_groups():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_1x128(torch.zeros(2, 200))


# (b) the block-scaled GEMM, emulated


@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (5, 384, 256), (64, 256, 512)])
def test_emulated_gemm_equals_the_dequantized_product(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w_true = torch.randn(n, k, generator=gen) * k**-0.5
    w, w_scale = quantize_weight(w_true)
    x_q, x_scale = quantize_1x128(x)
    got = emulated_block_scaled_mm(x_q, scale_a_layout(x_scale), w, scale_b_layout(w_scale), torch.float32)
    dequant = _dequantize_act(x_q, x_scale) @ dequantize_fp8_block(w, w_scale, (128, 128), "w").t()
    assert torch.allclose(got, dequant, rtol=1e-5, atol=1e-5)
    exact = x @ w_true.t()
    cosine = F.cosine_similarity(got.flatten(), exact.flatten(), dim=0).item()
    assert cosine > 0.999, cosine
    assert (got - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_fp8_linear_on_the_emulated_gemm(monkeypatch, rows):
    """Fp8Linear's call (row padding to 4, layouts, bias, leading dims) over the emulated GEMM equals
    the dequantized linear on the quantized activations."""
    monkeypatch.setattr(fp8, "block_scaled_mm", emulated_block_scaled_mm)
    gen = torch.Generator().manual_seed(rows)
    w, w_scale = quantize_weight(torch.randn(256, 384, generator=gen) * 0.05)
    bias = torch.randn(256, generator=gen).to(torch.bfloat16)
    lin = Fp8Linear(w, w_scale, torch.bfloat16, bias)
    x = torch.randn(2, rows, 384, generator=gen).to(torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, rows, 256) and y.dtype == torch.bfloat16
    x_q, x_scale = quantize_1x128(x.reshape(-1, 384))
    want = _dequantize_act(x_q, x_scale) @ dequantize_fp8_block(w, w_scale, (128, 128), "w").t()
    want = want.to(torch.bfloat16) + bias
    assert torch.allclose(y.float().reshape(-1, 256), want.float(), atol=2e-2, rtol=1e-2)
    assert lin.nbytes == 256 * 384 + 4 * 2 * 4  # the FP8 weight and its [L4=4, N/128=2] scales
    assert torch.equal(lin.scale_inv, w_scale)


# (c) the torch API called, and the layouts it requires


def test_torch_has_the_block_scaled_gemm_called():
    params = inspect.signature(F.scaled_mm).parameters
    for name in ("mat_a", "mat_b", "scale_a", "scale_recipe_a", "scale_b", "scale_recipe_b", "output_dtype"):
        assert name in params, f"torch.nn.functional.scaled_mm lost its {name!r} parameter"
    assert params["use_fast_accum"].default is False  # the accurate accumulation is the default we rely on
    assert hasattr(F.ScalingType, "BlockWise1x128") and hasattr(F.ScalingType, "BlockWise128x128")
    schema = str(torch.ops.aten._scaled_mm_v2.default._schema)
    assert "Tensor[] scale_a, int[] recipe_a" in schema and "Tensor[] scale_b, int[] recipe_b" in schema
    assert fp8._torch_has_block_scaled_mm()


def test_torch_meta_kernel_enforces_the_layouts():
    """The negative control: torch's meta kernel does check what the next test relies on, so the
    layouts passing it means something."""
    m, n, k = 4, 256, 256
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    good_a, good_b = scale_a_layout(torch.empty(m, 2, device="meta")), scale_b_layout(torch.empty(2, 2, device="meta"))
    fp8.block_scaled_mm(a, good_a, w, good_b, torch.bfloat16)
    with pytest.raises(RuntimeError, match="1x128 x 128x128"):
        fp8.block_scaled_mm(a, torch.empty(m, 2, device="meta"), w, good_b, torch.bfloat16)  # K-major scale_a
    with pytest.raises(RuntimeError, match="1x128 x 128x128"):
        fp8.block_scaled_mm(a, good_a, w, torch.empty(2, 2, device="meta").t(), torch.bfloat16)  # unpadded
    with pytest.raises(RuntimeError, match="col_major"):
        F.scaled_mm(a, w, good_a, F.ScalingType.BlockWise1x128, good_b, F.ScalingType.BlockWise128x128)


@pytest.mark.parametrize("n, k", [(128, 128), (512, 128), (128, 384), (768, 1024), (256, 640)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 256])
def test_fp8_linear_operands_pass_torch_checks(n, k, rows):
    """Fp8Linear's whole call on meta tensors: torch's `_scaled_mm_v2` meta kernel validates the
    operands it builds (shapes, strides, dtypes) for each of these shapes."""
    lin = Fp8Linear(
        torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(n // 128, k // 128, device="meta"),
        torch.bfloat16,
    )
    l4 = -(-(k // 128) // 4) * 4
    assert lin.scale_b.shape == (l4, n // 128) and lin.scale_b.stride() == (1, l4)
    assert lin.scale_b.dtype == torch.float32
    assert lin.qweight.t().stride() == (1, k)  # mat_b: column-major [K, N]
    y = lin(torch.empty(rows, k, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    _, x_scale = quantize_1x128(torch.empty(rows + (-rows % 4), k, device="meta"))
    laid = scale_a_layout(x_scale)
    assert laid.shape == (rows + (-rows % 4), k // 128) and laid.stride()[0] == 1


def test_fp8_linear_refuses_what_the_gemm_cannot_take():
    w = torch.zeros(192, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 128"):
        Fp8Linear(w, torch.ones(2, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Fp8Linear(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), torch.float32)


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
