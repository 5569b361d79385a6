"""ModelConfig: the architecture facts of a Hugging Face decoder checkpoint (the Llama family,
Qwen3, and the mixture-of-experts models Qwen3-MoE and Mixtral), read from config.json.

Whatever config.json asks for that pdserve does not implement is refused here, at start, with the
key named (`ValueError`), never served wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Per-head RMSNorm on q and k before the rotary embedding."""
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")
"""One window over every layer; the Qwen families window only some layers, which is refused."""
FP8_BLOCK = (128, 128)
"""The one FP8 block shape served (Qwen3-*-FP8, DeepSeek-V3): `weight_block_size` [128, 128]."""


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: each token's `top_k` experts by softmax router score.

    Layer i is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
    (Qwen3-MoE's keys); those layers run a dense MLP of `intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's MLP width (Qwen3-MoE's `moe_intermediate_size`; Mixtral's `intermediate_size`)."""
    norm_topk_prob: bool
    """Renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen3-MoE by its key)."""
    float32_weights: bool
    """Scale expert outputs by float32 routing weights (Mixtral), or by weights cast to the model's
    dtype (Qwen3-MoE), as transformers does: it matters in bfloat16."""
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (global index) has the expert MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of rotary embeddings (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: RopeScaling | None
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
        return cls(
            name=name,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_parse_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=_parse_sliding_window(arch, raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            moe=_parse_moe(arch, raw),
            fp8_block=_parse_quantization(raw.get("quantization_config")),
        )


def _check_activation(raw: dict) -> None:
    """Every served architecture gates its MLP with SiLU; another activation is refused by name."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: pdserve's MLPs are SiLU-gated")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: pdserve's MLP projections have no bias")


def _parse_moe(arch: str, raw: dict) -> MoeConfig | None:
    """The expert MLP of Qwen3-MoE and Mixtral; a routing or expert layout pdserve lacks is refused
    with its config key named."""
    if arch not in MOE_ARCHITECTURES:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if raw.get(key):
                raise ValueError(f"{key}={raw[key]} on {arch}: pdserve runs {arch} with dense MLPs only")
        return None
    qwen = arch == "Qwen3MoeForCausalLM"
    experts = raw.get("num_experts") if qwen else raw.get("num_local_experts")
    experts = experts or raw.get("num_local_experts") or raw.get("num_experts")  # transformers 5 names both
    key = "num_experts" if qwen else "num_local_experts"
    if not experts or int(experts) < 1:
        raise ValueError(f"{arch} needs a positive {key}, got {experts!r}")
    top_k = int(raw.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= int(experts):
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and {key}={experts}")
    # routing functions and shared experts of other MoE families, refused rather than ignored
    for name, served in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        if raw.get(name) not in (None, served):
            raise ValueError(f"{name}={raw[name]!r} is not supported: {arch} routes by {served} top-k")
    for name in ("shared_expert_intermediate_size", "n_shared_experts", "moe_shared_expert_intermediate_size"):
        if raw.get(name):
            raise ValueError(f"{name}={raw[name]}: {arch} has no shared expert in pdserve (nor in transformers)")
    if raw.get("n_group") not in (None, 1) or raw.get("topk_group") not in (None, 1):
        raise ValueError(f"group-limited routing (n_group, topk_group) is not supported on {arch}")
    step = int(raw.get("decoder_sparse_step", 1) or 1) if qwen else 1
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be positive, got {step}")
    only = tuple(int(i) for i in (raw.get("mlp_only_layers") or [])) if qwen else ()
    width = raw.get("moe_intermediate_size") if qwen else raw.get("intermediate_size")
    if not width:
        raise ValueError(f"{arch} needs {'moe_intermediate_size' if qwen else 'intermediate_size'}")
    return MoeConfig(
        num_experts=int(experts),
        top_k=top_k,
        intermediate_size=int(width),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if qwen else True,
        float32_weights=not qwen,
        decoder_sparse_step=step,
        mlp_only_layers=only,
    )


def _parse_quantization(raw: dict | None) -> tuple[int, int] | None:
    """FP8 block quantization (the one scheme served); any other `quant_method` is refused by name,
    so a quantized checkpoint is never loaded as garbage."""
    if not raw:
        return None
    method = raw.get("quant_method")
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


def _parse_rope_scaling(raw: dict | None) -> RopeScaling | None:
    """None for plain RoPE; RopeScaling for `llama3`; ValueError for anything else."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: pdserve supports 'llama3' and plain RoPE")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
