"""How a Llama checkpoint is split over tensor-parallel ranks: the one place that knows it.

Megatron-style: q/k/v and gate/up are column-parallel (each rank holds a block of output rows),
o_proj and down are row-parallel (each rank holds the matching block of input columns, and the
partial outputs are summed by one all-reduce per attention block and one per MLP). The embedding,
the norms and the LM head are replicated on every rank (a documented choice: the tiny and bench
models' vocabularies are small, and a replicated head needs no gather before sampling).

A mixture-of-experts layer's router is replicated. Its experts are either split like the dense MLP,
each expert's gate/up by rows and down by columns (`--tensor-parallel-size`), or, with expert
parallelism (`--enable-expert-parallel`, vLLM's flag), placed whole, a contiguous range of experts on
each rank; either way each rank's partial MLP output is summed by the same all-reduce.

DeepSeek's latent attention splits its heads the same way (q's and kv_b_proj's rows, o_proj's
columns), while the latent, one KV "head", is whole on every rank; its shared expert is split like a
dense MLP.

gpt-oss adds biases and sinks: q/k/v's biases and the sinks [Hq] go with their heads; a bias added
after a row-parallel projection (o_proj's, and each expert's down bias unless experts are placed
whole) is held whole by rank 0 and as zeros by the others (`zeroes`), so the all-reduce adds it once.
Its experts are stored fused over all of them ([E, ...] tensors): sliced by I within each expert, or
by E under expert parallelism, each expert's biases with it.

KV heads are split like the query heads. When a model has fewer KV heads than ranks, each KV head
is replicated on `size / num_kv_heads` ranks, as vLLM does, so that every rank holds the one KV
head its query heads attend to. A later fusion of q/k/v or gate/up in the checkpoint changes only
`tensor_slice` here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.model_config import GPT_OSS, ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` ranks."""

    rank: int
    size: int
    expert_parallel: bool = False
    """Experts are placed whole on ranks instead of each being split over all of them."""

    def check(self, cfg: ModelConfig) -> None:
        """ValueError naming what cannot be split `size` ways."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a valid rank")
        hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        if hq % self.size:
            raise ValueError(f"tensor-parallel size {self.size} does not divide the {hq} attention heads")
        if hkv % self.size and self.size % hkv:
            raise ValueError(
                f"tensor-parallel size {self.size} and the {hkv} KV heads: one must divide the other "
                "(KV heads are split, or replicated when there are fewer than ranks)"
            )
        if inter % self.size and any(not cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)):
            raise ValueError(f"tensor-parallel size {self.size} does not divide intermediate_size {inter}")
        if cfg.moe is not None and self.expert_parallel and cfg.moe.num_experts % self.size:
            raise ValueError(f"expert-parallel size {self.size} does not divide the {cfg.moe.num_experts} experts")
        if cfg.moe is not None and not self.expert_parallel and cfg.moe.intermediate_size % self.size:
            raise ValueError(
                f"tensor-parallel size {self.size} does not divide the experts' width {cfg.moe.intermediate_size} "
                "(--enable-expert-parallel places whole experts instead)"
            )
        if self.expert_parallel and cfg.moe is None:
            raise ValueError("--enable-expert-parallel needs a mixture-of-experts model")
        if cfg.moe is not None and cfg.moe.shared_intermediate_size % self.size:
            raise ValueError(
                f"tensor-parallel size {self.size} does not divide the shared experts' width "
                f"{cfg.moe.shared_intermediate_size}"
            )

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[start, stop) of the query heads this rank computes."""
        n = cfg.num_attention_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[start, stop) of the KV heads this rank holds (one replicated head when KV heads < ranks)."""
        return kv_head_range(cfg.num_key_value_heads, self.rank, self.size)

    def experts(self, cfg: ModelConfig) -> range | None:
        """The experts this rank holds under expert parallelism; None: all of them (each split)."""
        if cfg.moe is None or not self.expert_parallel:
            return None
        n = cfg.moe.num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The geometry one rank computes with: its share of heads and of the MLP width (of each
        expert's width too, unless experts are placed whole)."""
        kv_start, kv_stop = self.kv_heads(cfg)
        moe = cfg.moe
        if moe is not None:  # the shared expert is split like a dense MLP, with or without expert parallelism
            moe = dataclasses.replace(moe, shared_intermediate_size=moe.shared_intermediate_size // self.size)
        if moe is not None and not self.expert_parallel:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size)
        held = self.experts(cfg)
        if moe is not None and held is not None:
            moe = dataclasses.replace(moe, expert_range=(held.start, held.stop))
        return dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // self.size,
            num_key_value_heads=kv_stop - kv_start,
            intermediate_size=cfg.intermediate_size // self.size,
            moe=moe,
        )

    def tensor_slice(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` on this rank; None: the whole tensor."""
        if self.size == 1 or ".layers." not in name:
            return None  # embedding, final norm, LM head: replicated
        d = cfg.head_dim
        inter = cfg.intermediate_size // self.size
        if ".shared_experts." in name:
            assert cfg.moe is not None
            width = cfg.moe.shared_intermediate_size // self.size
            return (1 if ".down_proj." in name else 0), self.rank * width, (self.rank + 1) * width
        if cfg.mla is not None and ".self_attn." in name:
            return self._mla_slice(name, cfg)
        if cfg.architecture == GPT_OSS and ".mlp.experts." in name:
            return self._fused_expert_slice(name, cfg)
        if name.endswith(".self_attn.o_proj.bias"):
            return None  # whole, and zeros on all but rank 0 (`zeroes`)
        if name.endswith(".self_attn.sinks"):
            return 0, *self.q_heads(cfg)
        if ".experts." in name:
            if self.expert_parallel or cfg.moe is None:
                return None  # whole experts (which ones: `experts`)
            width = cfg.moe.intermediate_size // self.size
            if name.endswith((".w2.weight", ".down_proj.weight")):
                return 1, self.rank * width, (self.rank + 1) * width
            return 0, self.rank * width, (self.rank + 1) * width
        if ".self_attn.q_proj." in name:
            q0, q1 = self.q_heads(cfg)
            return 0, q0 * d, q1 * d
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            k0, k1 = self.kv_heads(cfg)
            return 0, k0 * d, k1 * d
        if ".self_attn.o_proj." in name:
            q0, q1 = self.q_heads(cfg)
            return 1, q0 * d, q1 * d
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return 0, self.rank * inter, (self.rank + 1) * inter
        if ".mlp.down_proj." in name:
            return 1, self.rank * inter, (self.rank + 1) * inter
        return None  # the layer norms

    def zeroes(self, name: str) -> bool:
        """Whether this rank holds zeros in place of tensor `name`: a bias added after a row-parallel
        projection, whose ranks' outputs the all-reduce sums, is kept by rank 0 alone to be added once
        (an expert's down bias is not split under expert parallelism: its expert runs on one rank)."""
        if self.size == 1 or self.rank == 0:
            return False
        down_bias = name.endswith(".mlp.experts.down_proj_bias") and not self.expert_parallel
        return down_bias or name.endswith(".self_attn.o_proj.bias")

    def _fused_expert_slice(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """gpt-oss's experts, each tensor over all of them: gate_up_proj [E, H, 2I], its bias [E, 2I],
        down_proj [E, I, H], its bias [E, H]. Expert parallelism: this rank's experts (dim 0), biases
        included. Else each expert's share [i0, i1) of I: gate and up interleave along 2I (gate at
        even columns), so that share is the contiguous columns [2 * i0, 2 * i1); down's bias is whole
        (`zeroes`)."""
        assert cfg.moe is not None
        held = self.experts(cfg)
        if held is not None:
            return 0, held.start, held.stop
        width = cfg.moe.intermediate_size // self.size
        i0, i1 = self.rank * width, (self.rank + 1) * width
        if name.endswith(".down_proj_bias"):
            return None
        if name.endswith(".down_proj"):
            return 1, i0, i1
        return (1 if name.endswith("_bias") else 2), 2 * i0, 2 * i1

    def _mla_slice(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """MLA: q's up-projection and kv_b_proj by this rank's heads, o_proj by their value columns;
        the latent's projections and norms are whole on every rank (each rank caches the whole latent)."""
        assert cfg.mla is not None
        q0, q1 = self.q_heads(cfg)
        m = cfg.mla
        if ".q_proj." in name or ".q_b_proj." in name:
            width = m.qk_nope_head_dim + m.qk_rope_head_dim
            return 0, q0 * width, q1 * width
        if ".kv_b_proj." in name:
            width = m.qk_nope_head_dim + m.v_head_dim
            return 0, q0 * width, q1 * width
        if ".o_proj." in name:
            return 1, q0 * m.v_head_dim, q1 * m.v_head_dim
        return None


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """KV heads [start, stop) of `rank` in a group of `size`; with fewer heads than ranks, the
    one head shared by ranks `h * size / num_kv_heads ...` (vLLM's replication)."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return rank * n, (rank + 1) * n
    head = rank // (size // num_kv_heads)
    return head, head + 1
