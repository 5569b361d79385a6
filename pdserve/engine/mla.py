"""DeepSeek's multi-head latent attention (MLA) over a KV pool that holds the latent, not K/V.

Each token caches one vector per layer: the RMS-normed latent `c` (`kv_lora_rank` values) and its
rotated shared key `k_pe` (`qk_rope_head_dim`). transformers expands it through `kv_b_proj` into
per-head keys `[W_UK c, k_pe]` and values `W_UV c`. Here the up-projections are absorbed instead
(DeepSeek-V2's paper, section 2.1.3; vLLM and SGLang decode this way): head h's query becomes
`[q_nope W_UK[h], q_pe]`, whose dot product with `[c, k_pe]` equals the expanded `q . k`; so every
head attends over the one cached latent in place (multi-query attention of head dim
`kv_lora_rank + qk_rope_head_dim`), and the output's first `kv_lora_rank` values, times `W_UV[h]`,
are head h's value mix. Nothing per-head is ever cached or rebuilt from the cache.

The pool layer is `[N, 1, 1, B, latent_dim]` (`ModelConfig.kv_planes` is 1): the attention
backends read the value from the key plane. Prompts run the same absorbed path: one code path, and
the pool gets exactly the latent the decode node reads. (Expanding for long prompts, as vLLM does,
saves attention FLOPs there; not done yet.)

Rotary dims: DeepSeek checkpoints lay them out in interleaved pairs; `MlaAttention.load` permutes
those weight rows once (evens, then odds), after which rotate-half is the same rotation, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.fp8 import dequantize_fp8_block, fused_linear
from pdserve.engine.layers import Linear, apply_rotary, rms_norm
from pdserve.engine.model_config import MlaConfig, ModelConfig

LATENT_NORM_EPS = 1e-6
"""The eps of `q_a_layernorm` and `kv_a_layernorm`: transformers builds them with its RMSNorm default,
not the config's `rms_norm_eps`."""


@dataclass
class MlaAttention:
    """One layer's MLA weights (this rank's heads under tensor parallelism; the latent is whole on
    every rank) and its attention block: hidden [T, H] -> [T, heads * v_head_dim] before o_proj."""

    mla: MlaConfig
    heads: int
    a_proj: Linear
    """q_a_proj (or q_proj, without a q LoRA) and kv_a_proj_with_mqa fused: both read h."""
    q_width: int
    """Rows of `a_proj` that are q's: q_lora_rank, or heads * qk_head_dim."""
    q_a_norm: torch.Tensor | None
    q_b: Linear | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    """[heads, qk_nope_head_dim, kv_lora_rank]: absorbed into each head's query."""
    w_uv_t: torch.Tensor
    """[heads, kv_lora_rank, v_head_dim]: turns a head's latent mix into its value output."""

    @classmethod
    def load(
        cls, cfg: ModelConfig, t: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, prepack: bool
    ) -> "MlaAttention":
        """Pop layer `prefix`'s attention tensors from `t` (`prefix` ends in "self_attn.")."""
        mla, heads = cfg.mla, cfg.num_attention_heads
        assert mla is not None
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q_name = "q_a_proj" if mla.q_lora_rank is not None else "q_proj"
        q_w, kv_w = t.pop(prefix + q_name + ".weight"), t.pop(prefix + "kv_a_proj_with_mqa.weight")
        q_s = t.pop(prefix + q_name + ".weight_scale_inv", None)
        kv_s = t.pop(prefix + "kv_a_proj_with_mqa.weight_scale_inv", None)
        _check_rows(kv_w, mla.latent_dim, prefix + "kv_a_proj_with_mqa")
        if mla.rope_interleave:
            kv_w = _deinterleave(kv_w, mla.kv_lora_rank, mla.qk_rope_head_dim, 1, kv_s)
        q_b = None
        if mla.q_lora_rank is None:
            _check_rows(q_w, heads * qk, prefix + "q_proj")
            if mla.rope_interleave:
                q_w = _deinterleave(q_w, mla.qk_nope_head_dim, mla.qk_rope_head_dim, heads, q_s)
            q_width = heads * qk
        else:
            _check_rows(q_w, mla.q_lora_rank, prefix + "q_a_proj")
            qb_w, qb_s = t.pop(prefix + "q_b_proj.weight"), t.pop(prefix + "q_b_proj.weight_scale_inv", None)
            _check_rows(qb_w, heads * qk, prefix + "q_b_proj")
            if mla.rope_interleave:
                qb_w = _deinterleave(qb_w, mla.qk_nope_head_dim, mla.qk_rope_head_dim, heads, qb_s)
            q_b = fused_linear([qb_w], [qb_s], dtype, None, prepack, prefix + "q_b_proj")
            q_width = mla.q_lora_rank
        a_proj = fused_linear([q_w, kv_w], [q_s, kv_s], dtype, None, prepack, prefix + q_name)
        kv_b = _dense(t, prefix + "kv_b_proj", cfg, dtype)
        _check_rows(kv_b, heads * (mla.qk_nope_head_dim + mla.v_head_dim), prefix + "kv_b_proj")
        if kv_b.shape[1] != mla.kv_lora_rank:
            raise ValueError(
                f"{prefix}kv_b_proj.weight has {kv_b.shape[1]} input columns, but kv_lora_rank is {mla.kv_lora_rank}"
            )
        w_uk, w_uv = kv_b.view(heads, -1, mla.kv_lora_rank).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        return cls(
            mla=mla,
            heads=heads,
            a_proj=a_proj,
            q_width=q_width,
            q_a_norm=t.pop(prefix + "q_a_layernorm.weight", None),
            q_b=q_b,
            kv_a_norm=t.pop(prefix + "kv_a_layernorm.weight"),
            w_uk=w_uk.contiguous(),
            w_uv_t=w_uv.transpose(1, 2).contiguous(),
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """h [T, H] (the model's dtype), cos/sin [T, 1, qk_rope_head_dim] -> [T, heads * v_head_dim]."""
        mla, t = self.mla, h.shape[0]
        a = self.a_proj(h)
        q, latent = a.split([self.q_width, mla.latent_dim], dim=-1)
        if self.q_b is not None:
            assert self.q_a_norm is not None
            q = self.q_b(rms_norm(q, self.q_a_norm, LATENT_NORM_EPS))
        q_nope, q_pe = q.reshape(t, self.heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        # the cached vector: normed latent, rotated shared key; [T, 1, latent_dim], one KV "head"
        kv = torch.cat([rms_norm(c, self.kv_a_norm, LATENT_NORM_EPS), apply_rotary(k_pe[:, None], cos, sin)[:, 0]], -1)
        kv = kv[:, None]
        # [heads, T, nope] contiguous first: bmm on a transposed view of few rows was up to 7x slower (bf16)
        q_latent = torch.bmm(q_nope.transpose(0, 1).contiguous(), self.w_uk).transpose(0, 1)  # [T, heads, kv_lora]
        query = torch.cat([q_latent, apply_rotary(q_pe, cos, sin)], dim=-1)
        out = attn.forward(query, kv, kv, kv_layer, meta, mla.softmax_scale)  # [T, heads, latent_dim]
        values = torch.bmm(out[..., : mla.kv_lora_rank].transpose(0, 1), self.w_uv_t)  # [heads, T, v_head_dim]
        return values.transpose(0, 1).reshape(t, self.heads * mla.v_head_dim)

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.a_proj, self.q_b) if lin is not None]

    def weight_bytes(self) -> int:
        """Bytes one step reads besides the linears: the absorbed up-projections and the norms."""
        tensors = [self.w_uk, self.w_uv_t, self.kv_a_norm] + ([self.q_a_norm] if self.q_a_norm is not None else [])
        return sum(x.numel() * x.element_size() for x in tensors)


def _check_rows(w: torch.Tensor, rows: int, name: str) -> None:
    if w.shape[0] != rows:
        raise ValueError(f"{name}.weight has {w.shape[0]} rows; the config's MLA dims make it {rows}")


def _deinterleave(w: torch.Tensor, nope: int, rope: int, heads: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `heads` groups of [nope | rope] with each group's rope rows reordered from interleaved
    pairs (x0, x1), (x2, x3), ... to evens then odds, so rotate-half rotates the same pairs. An FP8
    weight keeps its block scales only if the reorder stays inside one 128-row block (checked)."""
    width = w.shape[0] // heads
    if scale is not None and any((h * width + nope) % 128 + rope > 128 for h in range(heads)):
        raise ValueError("FP8 MLA weights whose rotary rows straddle a 128-row scale block are not supported")
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    order = torch.arange(w.shape[0]).view(heads, width)
    order[:, nope : nope + rope] = order[:, nope : nope + rope][:, perm]
    return w.index_select(0, order.reshape(-1).to(w.device))


def _dense(t: dict[str, torch.Tensor], name: str, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a plain tensor of `dtype` (FP8 ones dequantized: kv_b_proj is absorbed, never a GEMM)."""
    w, scale = t.pop(name + ".weight"), t.pop(name + ".weight_scale_inv", None)
    if scale is not None:
        assert cfg.fp8_block is not None
        w = dequantize_fp8_block(w, scale.to(w.device), cfg.fp8_block, name)
    return w.to(dtype)
