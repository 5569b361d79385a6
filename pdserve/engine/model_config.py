"""ModelConfig: the architecture facts of a Hugging Face decoder checkpoint (the Llama family,
Qwen3, and the mixture-of-experts models Qwen3-MoE, Mixtral, DeepSeek-V2/V3 and gpt-oss), read from
config.json; the expert MLP's own keys are read by `engine.moe_config`.

Whatever config.json asks for that pdserve does not implement is refused here, at start, with the
key named (`ValueError`), never served wrong."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.engine.moe_config import MoeConfig, parse_deepseek_moe, parse_gpt_oss_moe, parse_moe
from pdserve.engine.rope_config import RopeScaling, YarnScaling, parse_rope_scaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
)
GPT_OSS = "GptOssForCausalLM"
"""Attention sinks, per-layer windows (`layer_types`), biased experts with a clamped SwiGLU."""
LAYER_WINDOWS = ("sliding_attention", "full_attention")
"""The `layer_types` of gpt-oss: a layer attends within `sliding_window`, or to every key."""
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
"""Multi-head latent attention (`MlaConfig`) and DeepSeek's MoE: shared experts, grouped routing."""
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Per-head RMSNorm on q and k before the rotary embedding."""
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")
"""One window over every layer; the Qwen families window only some layers, which is refused."""
FP8_BLOCK = (128, 128)
"""The one FP8 block shape served (Qwen3-*-FP8, DeepSeek-V3): `weight_block_size` [128, 128]."""


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: each token caches one latent of `kv_lora_rank` values
    (normed) plus one shared rotary key of `qk_rope_head_dim`, not per-head K/V. Heads see keys of
    `qk_nope_head_dim + qk_rope_head_dim` and values of `v_head_dim` through `kv_b_proj`.

    KV geometry (what the pool, CacheStore and sizing see): one KV "head" of
    `kv_lora_rank + qk_rope_head_dim` values and one plane (`ModelConfig.kv_planes` = 1): the value
    is the key plane's first `kv_lora_rank` values, never stored twice."""

    q_lora_rank: int | None
    """None: q comes from one `q_proj`; else `q_a_proj` -> RMSNorm -> `q_b_proj` (V2-Lite has none)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    """The rotary dims of q and k come in interleaved pairs in the checkpoint (V2 always, V3 by its
    key): the loader permutes those weight rows so the rotate-half convention applies."""
    softmax_scale: float
    """`(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`, times YaRN's `mscale_all_dim` factor squared."""

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped above at `limit`, up clamped to [-limit, limit],
    out = (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from `config.json` (+ `generation_config.json`)."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | YarnScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry a bias (Qwen2 always does)."""
    torch_dtype: str
    sliding_window: int | None
    """Mistral: each query attends to the last `sliding_window` keys only (its own included); None: all."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head of q and k (weights [head_dim]) before the rotary embedding."""
    moe: MoeConfig | None = None
    """The expert MLP of a mixture-of-experts model; None: every layer's MLP is dense."""
    fp8_block: tuple[int, int] | None = None
    """An FP8 block-quantized checkpoint (`quantization_config.quant_method: fp8`): its linear
    weights are float8_e4m3fn with one float32 `weight_scale_inv` per block of this shape."""
    mla: MlaConfig | None = None
    """DeepSeek's latent attention; then `num_key_value_heads` is 1 and `head_dim` is the latent
    width (`MlaConfig.latent_dim`): the KV geometry, not the heads' q/k width."""
    layer_windows: tuple[int, ...] | None = None
    """gpt-oss: each layer's attention window (0: full attention), by global layer index; then
    `sliding_window` is None, so the per-step metadata carries no model-wide window."""
    attention_sinks: bool = False
    """gpt-oss: a learned logit per query head (`self_attn.sinks`) joins each softmax's denominator."""
    output_bias: bool = False
    """o_proj carries a bias (gpt-oss's `attention_bias` covers q, k, v and o)."""
    swiglu: ClampedSwiglu | None = None
    """gpt-oss: experts as fused, interleaved, biased gate/up and down tensors with this activation."""
    mxfp4: bool = False
    """gpt-oss's MXFP4 checkpoints (`quant_method: mxfp4`): expert weights as `<name>_blocks` and
    `<name>_scales`, dequantized at load (`engine.mxfp4`)."""

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (global index) to pass a backend: None (the step's
        model-wide `sliding_window`), 0 (none on this layer) or W."""
        return self.layer_windows[layer] if self.layer_windows is not None else None

    @property
    def rotary_dim(self) -> int:
        """Dims of each q/k head the rotary embedding turns: MLA's `qk_rope_head_dim`, else `head_dim`."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Planes per KV block: 2 (K and V) for multi-head attention, 1 for MLA (the latent is both)."""
        return 1 if self.mla is not None else 2

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (global index) runs the expert MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} is not a Hugging Face checkpoint directory: config.json not found")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen, name=path.name)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None, *, name: str = "model") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else raw.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        bias = bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM"))
        _check_activation(raw)
        mla = _parse_mla(arch, raw)
        if mla is not None and bias:
            raise ValueError(f"attention_bias=true is not supported on {arch}")
        config = cls(
            name=name,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            # MLA: the KV geometry is one latent "head" (MlaConfig), whatever the checkpoint says of heads
            num_key_value_heads=1 if mla else int(raw.get("num_key_value_heads") or heads),
            head_dim=mla.latent_dim if mla else int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=parse_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=_parse_sliding_window(arch, raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            moe=_parse_experts(arch, raw),
            mla=mla,
            fp8_block=_parse_quantization(raw.get("quantization_config")),
        )
        return _with_gpt_oss(config, raw)


def _parse_experts(arch: str, raw: dict) -> MoeConfig | None:
    """The expert MLP, by family (`engine.moe_config`): DeepSeek's, gpt-oss's, else Qwen3-MoE's and
    Mixtral's, or none for a dense architecture."""
    if arch in DEEPSEEK_ARCHITECTURES:
        return parse_deepseek_moe(arch, raw)
    return parse_gpt_oss_moe(raw) if arch == GPT_OSS else parse_moe(arch, raw)


def _check_activation(raw: dict) -> None:
    """Every served architecture gates its MLP with SiLU; another activation is refused by name."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: pdserve's MLPs are SiLU-gated")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: pdserve's MLP projections have no bias")


def _parse_mla(arch: str, raw: dict) -> MlaConfig | None:
    """DeepSeek's latent attention dims; None for every other architecture."""
    if arch not in DEEPSEEK_ARCHITECTURES:
        return None
    dims = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = raw.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arch} needs a positive integer {key}, got {value!r}")
        dims[key] = value
    if dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {dims['qk_rope_head_dim']}")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora < 1):
        raise ValueError(f"q_lora_rank must be a positive integer or null, got {q_lora!r}")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope.get("factor") or 1.0)
        m = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return MlaConfig(
        q_lora_rank=q_lora,
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True)),
        softmax_scale=scale,
        **dims,
    )


def _parse_quantization(raw: dict | None) -> tuple[int, int] | None:
    """FP8 block quantization (the one scheme served); any other `quant_method` is refused by name,
    so a quantized checkpoint is never loaded as garbage."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "mxfp4":  # gpt-oss's expert format: `_with_gpt_oss` takes it (and refuses it elsewhere)
        return None
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported: pdserve serves unquantized "
            "checkpoints and FP8 block-quantized ones (quant_method 'fp8', weight_block_size [128, 128])"
        )
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {raw['activation_scheme']!r} is not supported: only 'dynamic'"
        )
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {raw['fmt']!r} is not supported: only 'e4m3'")
    block = raw.get("weight_block_size")
    if block is None or [int(b) for b in block] != list(FP8_BLOCK):
        raise ValueError(
            f"quantization_config.weight_block_size {block!r} is not supported: only {list(FP8_BLOCK)} "
            "(per-tensor FP8 scales are not served)"
        )
    return FP8_BLOCK


def _parse_sliding_window(arch: str, raw: dict) -> int | None:
    """Mistral's and Mixtral's window (null or absent: none). Qwen2 and Qwen3 window only some layers
    when `use_sliding_window` is set, which pdserve does not run: refused rather than served wrong."""
    if arch not in SLIDING_WINDOW_ARCHITECTURES:
        if raw.get("use_sliding_window"):
            family = arch.removesuffix("ForCausalLM")
            raise ValueError(f"{family} with use_sliding_window=true (per-layer windows) is not supported by pdserve")
        return None
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    if int(window) < 1:
        raise ValueError(f"sliding_window must be positive, got {window}")
    return int(window)


GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' GptOssConfig when config.json has neither rope_scaling nor rope_parameters."""


def _with_gpt_oss(config: ModelConfig, raw: dict) -> ModelConfig:
    """gpt-oss's own keys over the common ones: per-layer windows, sinks, biases on q/k/v/o, the
    clamped SwiGLU, MXFP4 experts, and transformers' defaults for keys its config may leave out
    (attention_bias true, rope_theta 150000, `GPT_OSS_DEFAULT_ROPE`). Any other architecture is
    returned as it is, an MXFP4 `quantization_config` refused on it."""
    mxfp4 = (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    if config.architecture != GPT_OSS:
        if mxfp4:
            raise ValueError(
                f"quantization_config.quant_method 'mxfp4' is not supported on {config.architecture}: "
                "pdserve reads MXFP4 for gpt-oss's experts only"
            )
        return config
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    theta = raw.get("rope_theta", (rope or {}).get("rope_theta", 150000.0))
    bias = bool(raw.get("attention_bias", True))
    return replace(
        config,
        rope_theta=float(theta),
        rope_scaling=parse_rope_scaling(rope or GPT_OSS_DEFAULT_ROPE),
        attention_bias=bias,
        output_bias=bias,
        layer_windows=_parse_layer_windows(raw, config.num_hidden_layers),
        attention_sinks=True,
        swiglu=ClampedSwiglu(alpha=float(raw.get("swiglu_alpha", 1.702)), limit=float(raw.get("swiglu_limit", 7.0))),
        mxfp4=mxfp4,
    )


def _parse_layer_windows(raw: dict, layers: int) -> tuple[int, ...]:
    """Each layer's window from `layer_types` (0: full attention). Absent, transformers' default:
    sliding on even layers, full on odd ones."""
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must name one type for each of the {layers} layers, got {types!r}")
    window = raw.get("sliding_window")
    windows: list[int] = []
    for i, kind in enumerate(types):
        if kind not in LAYER_WINDOWS:
            raise ValueError(f"layer_types[{i}] {kind!r} is not supported: pdserve serves {', '.join(LAYER_WINDOWS)}")
        if kind == "full_attention":
            windows.append(0)
        elif isinstance(window, int) and window >= 1:
            windows.append(window)
        else:
            raise ValueError(f"layer_types[{i}] is sliding_attention but sliding_window is {window!r}")
    return tuple(windows)
