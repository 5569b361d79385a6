"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): softmax top-k routing, then each active
expert runs one GEMM pair over the tokens routed to it.

CPU path (`SparseMoe.forward`): the (token, slot) pairs are sorted by expert once; each expert that
any token chose runs its fused gate/up GEMM, SiLU-gating and down GEMM over its own rows only, on
the same prepacked `Linear` weights (and decode-size kernels) as a dense layer, and its rows are
scaled by their routing weights and added into the output. There is a loop over the active
experts, never over tokens: at most `num_experts` iterations a layer, each one a GEMM of all that
expert's tokens. We weighed a library kernel: torch has no fused CPU MoE, and vLLM's CPU MoE lives
in its own extension; the GEMMs here are the kernels the dense layers already use.

CUDA path (`SparseMoe.forward` on a CUDA tensor with `torch._grouped_mm`): all experts in one
grouped GEMM per projection over the expert-sorted rows (Hopper and later, bfloat16), the same
routing and combination; elsewhere it runs the loop above.

Exactness: routing is computed in float32 as transformers does, experts are visited in ascending
order and their outputs added in that order, as transformers' `index_add_` loop does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.layers import Linear
from pdserve.engine.moe_config import MoeConfig


@dataclass
class Expert:
    """One expert's weights: gate and up fused into one GEMM [2I, H], down [H, I]."""

    gate_up: Linear
    down: Linear


class SparseMoe:
    """One layer's router and the experts this process holds (all, or a contiguous range under
    expert parallelism: tokens routed elsewhere contribute nothing here, and the all-reduce that
    follows sums the ranks' shares)."""

    def __init__(
        self,
        config: MoeConfig,
        router: torch.Tensor,
        experts: dict[int, Expert],
        shared: Expert | None = None,
        score_bias: torch.Tensor | None = None,
    ) -> None:
        """`shared`: the shared expert every token runs (this rank's share of its width), DeepSeek;
        `score_bias`: V3's `e_score_correction_bias` [E], float32, added to the scores only to choose."""
        self.config = config
        self.router = router  # [E, H], replicated: every rank routes every token the same way
        self.experts = experts
        self.shared = shared
        self.score_bias = score_bias
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, k], expert ids [T, k]): softmax (or sigmoid) over the router
        logits in float32, top-k (greedy, or inside the best expert groups), renormalised and scaled
        when configured; weights in float32 or h's dtype, as configured."""
        cfg = self.config
        logits = F.linear(h.float(), self.router.float()) if cfg.router_float32 else F.linear(h, self.router)
        if cfg.scoring == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if cfg.topk_method == "greedy":
            weights, ids = torch.topk(scores, cfg.top_k, dim=-1)
        else:
            weights, ids = self._group_limited(scores)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        if not cfg.float32_weights:
            weights = weights.to(h.dtype)
        return weights, ids

    def _group_limited(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's routing inside the `topk_group` best of `n_group` expert groups: V2 ranks groups
        by their best score and picks experts by score; V3 (`noaux_tc`) ranks them by the sum of their
        two best bias-corrected scores, picks experts by corrected score and weights them by the raw one."""
        cfg = self.config
        choice = scores if self.score_bias is None else scores + self.score_bias
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, cfg.topk_group, dim=-1).indices, True)
        mask = keep[:, :, None].expand_as(grouped).reshape(-1, cfg.num_experts)
        if cfg.topk_method == "noaux_tc":
            ids = torch.topk(choice.masked_fill(~mask, float("-inf")), cfg.top_k, dim=-1).indices
            return scores.gather(1, ids), ids
        return torch.topk(scores.masked_fill(~mask, 0.0), cfg.top_k, dim=-1)

    def forward(self, h: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [T, H] -> this process's share of the MLP output [T, H]. `silu_mul`: [T, 2I] -> [T, I]
        (the layer's elementwise op, fused on CPU)."""
        weights, ids = self.route(h)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        tokens = order // self.config.top_k
        x = h.index_select(0, tokens)  # one gather: each expert's rows are a contiguous slice
        y = torch.zeros_like(x)  # rows of experts held by another rank stay zero
        if h.is_cuda and self._grouped_usable(h):
            self._grouped(x, y, counts, silu_mul)
        else:
            start = 0
            for e, n in enumerate(counts):
                expert = self.experts.get(e)
                if n and expert is not None:
                    y[start : start + n] = expert.down(silu_mul(expert.gate_up(x[start : start + n])))
                start += n
        y = y * weights.reshape(-1)[order][:, None]
        # one scatter, in expert order: each token's expert outputs are added in ascending expert order
        out = torch.zeros_like(h).index_add_(0, tokens, y.to(h.dtype))
        if self.shared is not None:  # DeepSeek: routed experts first, then the shared one, as transformers adds
            out += self.shared.down(silu_mul(self.shared.gate_up(h)))
        return out

    def _grouped_usable(self, h: torch.Tensor) -> bool:
        """Whether this step's experts run as grouped GEMMs (`_grouped`) rather than one by one."""
        return _grouped_mm_usable(h, self.experts)

    def _grouped(
        self, x: torch.Tensor, y: torch.Tensor, counts: list[int], silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """The local experts' rows of y (a contiguous range: experts are sorted) from one grouped GEMM
        per projection (CUDA, `torch._grouped_mm`)."""
        gate_up, down = self._stacked_weights()
        first, last = min(self.experts), max(self.experts) + 1
        lo, hi = sum(counts[:first]), sum(counts[:last])
        if hi == lo:
            return
        offs = torch.tensor(counts[first:last], device=x.device).cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x[lo:hi], gate_up, offs=offs)
        y[lo:hi] = torch._grouped_mm(silu_mul(gu), down, offs=offs)

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Local experts' weights stacked once, [E, N, K] in memory, handed to `_grouped_mm` as [E, K, N]
        views (the transposed layout it multiplies by); each expert's `Linear` then holds a view of the
        stack, so the weights are not held twice."""
        if self._stacked is None:
            experts = [self.experts[e] for e in sorted(self.experts)]
            gate_up = torch.stack([_dense(x.gate_up) for x in experts])
            down = torch.stack([_dense(x.down) for x in experts])
            for i, x in enumerate(experts):
                x.gate_up.weight, x.down.weight = gate_up[i], down[i]
            self._stacked = (gate_up.transpose(1, 2), down.transpose(1, 2))
        return self._stacked

    def weight_bytes(self) -> int:
        """Bytes of expert weights this process holds (all experts; a step reads the active ones)."""
        routed = sum(x.gate_up.nbytes + x.down.nbytes for x in self.experts.values())
        return routed + self._always_read()

    def active_weight_bytes(self) -> int:
        """Bytes of expert weights one token reads: its top-k experts (of this process's share)."""
        per_expert = max((x.gate_up.nbytes + x.down.nbytes for x in self.experts.values()), default=0)
        return per_expert * min(self.config.top_k, len(self.experts)) + self._always_read()

    def _always_read(self) -> int:
        """The router and the shared expert: read by every step."""
        shared = self.shared.gate_up.nbytes + self.shared.down.nbytes if self.shared is not None else 0
        return _nbytes(self.router) + shared


def _dense(lin: Linear) -> torch.Tensor:
    assert lin.weight is not None, "the CUDA grouped path needs unpacked weights"
    return lin.weight


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _grouped_mm_usable(h: torch.Tensor, experts: dict[int, Expert]) -> bool:
    """torch's grouped GEMM: CUDA capability 9.0+, bfloat16, a contiguous range of experts."""
    if not hasattr(torch, "_grouped_mm") or h.dtype != torch.bfloat16 or not experts:
        return False
    if torch.cuda.get_device_capability(h.device) < (9, 0):
        return False
    first = min(experts)
    return sorted(experts) == list(range(first, first + len(experts)))
