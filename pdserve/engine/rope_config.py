"""Rotary-embedding scaling of a checkpoint (`rope_scaling` or transformers 5's `rope_parameters`):
Llama-3's frequency scaling and YaRN, read by `ModelConfig.from_dict`; any other `rope_type` is
refused at start with the key named (`ValueError`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of rotary embeddings (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN scaling of rotary embeddings (`rope_type: yarn`; gpt-oss, DeepSeek): frequencies blended
    between interpolated (divided by `factor`) and original along a ramp over the dims set by
    `beta_fast`/`beta_slow`, and cos/sin scaled by an attention factor (`layers.yarn_inv_freq`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """Round the ramp's ends to whole dims (transformers' default when the key is absent)."""
    attention_factor: float | None = None
    """cos/sin scale; None: from `factor` (and `mscale`/`mscale_all_dim` when both are set)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None


def parse_rope_scaling(raw: dict | None) -> RopeScaling | YarnScaling | None:
    """None for plain RoPE; RopeScaling for `llama3`, YarnScaling for `yarn`; ValueError for anything else."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind == "yarn":
        return _parse_yarn(raw)
    if kind != "llama3":
        raise ValueError(
            f"unsupported rope_scaling rope_type {kind!r}: pdserve supports 'llama3', 'yarn' and plain RoPE"
        )
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _parse_yarn(raw: dict) -> YarnScaling:
    """YaRN's keys as transformers' `_compute_yarn_parameters` reads them (beta_fast 32 and beta_slow 1
    when absent or zero, truncate true when absent); `factor` and `original_max_position_embeddings`
    are required, named when absent."""
    for key in ("factor", "original_max_position_embeddings"):
        if raw.get(key) is None:
            raise ValueError(f"rope_scaling rope_type 'yarn' needs {key}")
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"rope_scaling partial_rotary_factor {raw['partial_rotary_factor']} is not supported")

    def optional(key: str) -> float | None:
        return float(raw[key]) if raw.get(key) is not None else None

    return YarnScaling(
        factor=float(raw["factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        truncate=bool(raw.get("truncate", True)),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
    )
