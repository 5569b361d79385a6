"""Small numeric building blocks of the Llama family: RMSNorm, rotary embeddings, and the
elementwise steps of a layer (eager torch, or fused C++ ops on CPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.model_config import ModelConfig, RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 scaling applied when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend the band in between."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for the rotate-half convention used by HF Llama checkpoints."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(config).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class EagerOps:
    """The elementwise steps of a decoder layer in plain torch ops: the reference, on any device."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += residual (in place, x: [T, H]); returns rms_norm(x)."""
        if residual is not None:
            x.add_(residual)
        return rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv: [T, (Hq + 2Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D] rotated, v [T, Hkv, D]."""
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return apply_rotary(q.view(-1, hq, d), cos, sin), apply_rotary(k.view(-1, hkv, d), cos, sin), v.view(-1, hkv, d)


class CpuFusedOps:
    """The same steps as `EagerOps`, one C++ pass each (`torch.ops.pdserve_cpu`, built by
    `engine.attention.cpu_build`); equal to EagerOps up to float rounding order."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.pdserve_cpu.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve_cpu.silu_mul(gate_up)

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # q and k heads sit side by side in each qkv row: one in-place pass rotates both
        torch.ops.pdserve_cpu.rotary(qkv, cos[:, 0], sin[:, 0], hq + hkv, d)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
