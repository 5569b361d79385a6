"""The decoder of every served architecture over a flat token batch: the Llama family (Llama 2/3,
Qwen2/2.5, Mistral), Qwen3 (per-head q/k norms) and the mixture-of-experts models Qwen3-MoE and
Mixtral (a sparse expert MLP, `engine.moe`, in place of the dense one on its layers), and gpt-oss
(attention sinks, per-layer windows, biased experts with a clamped SwiGLU: `engine.gpt_oss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.engine import cuda_ops
from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.fp8 import fused_linear
from pdserve.engine.gpt_oss import GptOssMoe, load_sinks
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.layers import CpuCarryOps, CpuFusedOps, EagerOps, Linear, RotaryEmbedding, apply_rotary, rms_norm
from pdserve.engine.mla import MlaAttention
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.moe import Expert, SparseMoe
from pdserve.engine.weights import expert_names, expert_prefix


@dataclass
class DecoderLayer:
    """One layer's weights, q/k/v and gate/up fused so each is one matmul."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | None  # [(Hq + 2*Hkv) * D, H], bias in Qwen2; None with MLA
    o_proj: Linear  # [H, Hq * D]
    gate_up: Linear | None  # [2 * I, H]; None on a sparse layer
    down: Linear | None  # [H, I]; None on a sparse layer
    q_norm: torch.Tensor | None = None  # [D], Qwen3
    k_norm: torch.Tensor | None = None  # [D], Qwen3
    moe: SparseMoe | None = None  # the expert MLP of a sparse layer
    mla: MlaAttention | None = None  # DeepSeek's latent attention, in place of qkv
    sinks: torch.Tensor | None = None  # [Hq], gpt-oss: one logit per head in each softmax's denominator

    def linears(self) -> list[Linear]:
        mla = self.mla.linears() if self.mla is not None else []
        return [lin for lin in (self.qkv, self.o_proj, self.gate_up, self.down) if lin is not None] + mla


class LlamaModel:
    """Holds the weights of layers [start, end) and runs them.

    Embeddings exist only on the first slice, final norm and lm_head only on the
    last, so pipeline stages hold just what they compute.
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        layer_range: tuple[int, int],
        device: torch.device,
        fused_ops: bool = True,
        prepack: bool = False,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`prepack`: hold the linear weights in oneDNN's layout (`Linear`, CPU only). `all_reduce`:
        this is one tensor-parallel rank (`config` its share, engine.parallel): the row-parallel
        o_proj and down outputs are summed over the ranks by it, once per block."""
        self.config = config
        self.fused_ops = fused_ops  # use CpuFusedOps on steps that run the compiled CPU ops
        self.start, self.end = layer_range
        self.is_first = self.start == 0
        self.is_last = self.end == config.num_hidden_layers
        self.embed = tensors.get("model.embed_tokens.weight")
        self.norm = tensors.get("model.norm.weight")
        head = tensors.get("lm_head.weight", self.embed) if self.is_last else None
        self.lm_head = Linear(head, prepack=prepack) if head is not None else None
        self.layers = [self._fuse(config, tensors, i, prepack) for i in range(self.start, self.end)]
        self.rotary = RotaryEmbedding(config, device)
        self.scale = config.head_dim**-0.5
        self.reduce = all_reduce or (lambda t: t)
        self.layers_run = 0
        """Decoder layers computed since load, over every forward: read from other threads as a sign
        of life (a node busy with one long prompt still advances it layer by layer)."""
        # bf16 linears through float32 (layers.bf16_via_float32): activations may travel as float32
        # between the fused ops and the GEMMs; not under tensor parallelism, whose all-reduce sums
        # each rank's bf16-rounded share
        self.carry = all_reduce is None and any(layer.o_proj.out_dtype is not None for layer in self.layers)

    @staticmethod
    def _fuse(cfg: ModelConfig, t: dict[str, torch.Tensor], i: int, prepack: bool) -> DecoderLayer:
        p = f"model.layers.{i}."
        dtype = t[p + "input_layernorm.weight"].dtype  # the compute dtype the loader gave every tensor

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            # weights kept FP8 by the loader arrive with their `<name>_scale_inv` (fp8.fused_linear)
            weights = [t.pop(p + n + ".weight") for n in names]
            scales = [t.pop(p + n + ".weight_scale_inv", None) for n in names]
            return fused_linear(weights, scales, dtype, bias, prepack, p + names[0])

        qkv, mla = None, None
        if cfg.mla is not None:
            mla = MlaAttention.load(cfg, t, p + "self_attn.", dtype, prepack)
        else:
            bias = None
            if p + "self_attn.q_proj.bias" in t:
                bias = torch.cat([t.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            qkv = linear([f"self_attn.{x}_proj" for x in "qkv"], bias)
        gate_up = down = moe = None
        if cfg.is_sparse(i):
            experts = GptOssMoe.load if cfg.swiglu is not None else LlamaModel._experts  # gpt-oss: biased, clamped
            moe = experts(cfg, t, i, prepack)
        else:
            gate_up = linear(["mlp.gate_proj", "mlp.up_proj"])
            down = linear(["mlp.down_proj"])
        return DecoderLayer(
            t.pop(p + "input_layernorm.weight"),
            t.pop(p + "post_attention_layernorm.weight"),
            qkv,
            linear(["self_attn.o_proj"], t.pop(p + "self_attn.o_proj.bias", None)),  # a bias in gpt-oss
            gate_up,
            down,
            t.pop(p + "self_attn.q_norm.weight", None),
            t.pop(p + "self_attn.k_norm.weight", None),
            moe,
            mla,
            sinks=load_sinks(cfg, t, i) if cfg.attention_sinks else None,
        )

    @staticmethod
    def _experts(cfg: ModelConfig, t: dict[str, torch.Tensor], i: int, prepack: bool) -> SparseMoe:
        """Layer i's router and the experts whose weights were loaded (all, or this rank's range)."""
        assert cfg.moe is not None
        prefix, (gate, up, down) = expert_prefix(cfg, i), expert_names(cfg)
        experts = {}
        for e in range(cfg.moe.num_experts):
            x = f"{prefix}experts.{e}."
            if x + f"{gate}.weight" in t:
                gate_up = torch.cat([t.pop(x + f"{gate}.weight"), t.pop(x + f"{up}.weight")])
                experts[e] = Expert(
                    Linear(gate_up, prepack=prepack), Linear(t.pop(x + f"{down}.weight"), prepack=prepack)
                )
        shared = None
        if cfg.moe.shared_intermediate_size:  # DeepSeek: one MLP every token runs, beside its routed experts
            x = prefix + "shared_experts."
            gate_up = torch.cat([t.pop(x + f"{gate}.weight"), t.pop(x + f"{up}.weight")])
            shared = Expert(Linear(gate_up, prepack=prepack), Linear(t.pop(x + f"{down}.weight"), prepack=prepack))
        bias = t.pop(prefix + "gate.e_score_correction_bias", None)
        router = t.pop(prefix + "gate.weight")
        if cfg.moe.router_float32:  # DeepSeek keeps its router in float32 whatever the model's dtype
            router, bias = router.float(), bias.float() if bias is not None else None
        return SparseMoe(cfg.moe, router, experts, shared, bias)

    def forward(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor | None,
        hidden: torch.Tensor | None,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        connector: KvConnector,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Returns hidden states [T, H] after layers `span` (default: this slice's; a sub-range of
        them), the final norm applied when that ends at the model's last layer."""
        cfg = self.config
        start, end = span or (self.start, self.end)
        assert self.start <= start < end <= self.end, f"layers {span} outside this slice's {self.start, self.end}"
        first, last = start == 0, end == cfg.num_hidden_layers
        layers, offset = self.layers[start - self.start : end - self.start], start - self.start
        # x is the residual stream, updated in place, so never the caller's tensor
        if first:
            assert input_ids is not None and self.embed is not None, "the first slice embeds token ids"
            x = F.embedding(input_ids, self.embed)
        else:
            assert hidden is not None, "a later slice continues the previous slice's hidden states"
            x = hidden.clone()
        attn.begin_step(meta, kv_pool.layer(0).shape)
        ops: type[EagerOps] | type[CpuFusedOps] = EagerOps
        if self.fused_ops and attn.uses_kernel and x.device.type == "cpu":
            ops = CpuCarryOps if self.carry else CpuFusedOps
        elif self.fused_ops and cuda_ops.available(x.device):  # one Triton kernel per elementwise step
            ops = cuda_ops.CudaFusedOps
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        hq, hkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        # the norm after each residual add, so every add is fused into the norm that reads it
        norms_after_mlp = [layer.input_norm for layer in layers[1:]] + [self.norm if last else None]
        h = ops.add_rms_norm(x, None, layers[0].input_norm, eps)
        for local, (layer, next_norm) in enumerate(zip(layers, norms_after_mlp), offset):
            connector.wait_for_layer(self.start + local)  # a restore of this layer's KV has landed
            if layer.mla is not None:  # latent attention: in the model's dtype (CpuCarryOps' h is float32)
                o = layer.mla.forward(h.to(x.dtype), cos, sin, attn, kv_pool.layer(local), meta)
            else:  # attention block: h [T, H] -> qkv [T, (Hq + 2Hkv) * D]
                assert layer.qkv is not None
                qkv = ops.linear(layer.qkv, h)
                if layer.q_norm is not None and layer.k_norm is not None:
                    q, k, v = self._norm_rotate_qk(ops, qkv.to(x.dtype), layer.q_norm, layer.k_norm, cos, sin)
                else:
                    q, k, v = ops.rotate_qk(qkv, cos, sin, hq, hkv, d)
                window, sinks = cfg.layer_window(self.start + local), layer.sinks  # gpt-oss's per layer
                o = attn.forward(q, k, v, kv_pool.layer(local), meta, self.scale, window=window, sinks=sinks)
                o = o.reshape(-1, hq * d)
            connector.save_layer(self.start + local, batch)
            h = ops.add_rms_norm(x, self.reduce(ops.linear(layer.o_proj, o)), layer.post_norm, eps)
            if layer.moe is not None:  # sparse MLP: in the model's dtype (CpuCarryOps' h is float32)
                silu_mul = CpuFusedOps.silu_mul if ops is CpuCarryOps else ops.silu_mul
                mlp = self.reduce(layer.moe.forward(h.to(x.dtype), silu_mul))
            else:  # MLP block: SiLU-gated, gate_up [T, 2I] -> [T, I]
                assert layer.gate_up is not None and layer.down is not None
                mlp = self.reduce(ops.linear(layer.down, ops.silu_mul(ops.linear(layer.gate_up, h))))
            if next_norm is None:  # a non-last pipeline stage hands on the un-normed stream
                x.add_(mlp.to(x.dtype))
            else:
                h = ops.add_rms_norm(x, mlp, next_norm, eps)
            self.layers_run += 1
        return h.to(x.dtype) if last else x  # CpuCarryOps' last norm is float32

    def _norm_rotate_qk(
        self,
        ops: type[EagerOps] | type[CpuFusedOps],
        qkv: torch.Tensor,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Qwen3: RMSNorm over each head of q and k (qkv [T, W] in the model's dtype), then the rotary
        embedding: eager, or on the CPU ops' path written back into qkv and rotated there in one pass."""
        cfg = self.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        qn = rms_norm(q.view(-1, hq, d), q_norm, cfg.rms_norm_eps)
        kn = rms_norm(k.view(-1, hkv, d), k_norm, cfg.rms_norm_eps)
        if ops is EagerOps:
            return apply_rotary(qn, cos, sin), apply_rotary(kn, cos, sin), v.view(-1, hkv, d)
        q.view(-1, hq, d).copy_(qn)
        k.view(-1, hkv, d).copy_(kn)
        # CpuCarryOps' rotation reads float32 GEMM output; qkv is in the model's dtype here
        return (CpuFusedOps if ops is CpuCarryOps else ops).rotate_qk(qkv, cos, sin, hq, hkv, d)

    def weight_bytes(self, one_token: bool = False) -> int:
        """Bytes of weights one decode step reads (every linear and norm, every expert a sparse layer
        holds; not the embedding table, of which a step reads one row per token). `one_token`: a step
        of one sequence, which reads only its top-k experts of each sparse layer."""
        total = sum(lin.nbytes for layer in self.layers for lin in layer.linears())
        total += sum(layer.mla.weight_bytes() for layer in self.layers if layer.mla is not None)
        for layer in self.layers:
            if layer.moe is not None:
                total += layer.moe.active_weight_bytes() if one_token else layer.moe.weight_bytes()
        norms = [t for layer in self.layers for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)]
        norms += [self.norm]
        total += sum(t.numel() * t.element_size() for t in norms if t is not None)
        return total + (self.lm_head.nbytes if self.lm_head is not None else 0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in the model's dtype (the sampler widens them where it needs to)."""
        assert self.lm_head is not None, "only the last slice has an lm_head"
        return self.lm_head(hidden)
