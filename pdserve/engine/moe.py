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
from pdserve.engine.model_config import MoeConfig


@dataclass
class Expert:
    """One expert's weights: gate and up fused into one GEMM [2I, H], down [H, I]."""

    gate_up: Linear
    down: Linear


class SparseMoe:
    """One layer's router and the experts this process holds (all, or a contiguous range under
    expert parallelism: tokens routed elsewhere contribute nothing here, and the all-reduce that
    follows sums the ranks' shares)."""

    def __init__(self, config: MoeConfig, router: torch.Tensor, experts: dict[int, Expert]) -> None:
        self.config = config
        self.router = router  # [E, H], replicated: every rank routes every token the same way
        self.experts = experts
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, k], expert ids [T, k]): softmax over the router logits in float32,
        top-k, renormalised when configured; weights in float32 or h's dtype, as configured."""
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.config.float32_weights:
            weights = weights.to(h.dtype)
        return weights, ids

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
        if h.is_cuda and _grouped_mm_usable(h, self.experts):
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
        return torch.zeros_like(h).index_add_(0, tokens, y.to(h.dtype))

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
        return sum(x.gate_up.nbytes + x.down.nbytes for x in self.experts.values()) + _nbytes(self.router)

    def active_weight_bytes(self) -> int:
        """Bytes of expert weights one token reads: its top-k experts (of this process's share)."""
        per_expert = max((x.gate_up.nbytes + x.down.nbytes for x in self.experts.values()), default=0)
        return per_expert * min(self.config.top_k, len(self.experts)) + _nbytes(self.router)


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
