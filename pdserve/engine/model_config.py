"""ModelConfig: the architecture facts of a Hugging Face Llama-family checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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
        )


def _parse_sliding_window(arch: str, raw: dict) -> int | None:
    """Mistral's window (null or absent: none). Qwen2 windows only some layers when
    `use_sliding_window` is set, which pdserve does not run: refused rather than served wrong."""
    if arch == "Qwen2ForCausalLM":
        if raw.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true (per-layer windows) is not supported by pdserve")
        return None
    window = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
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
