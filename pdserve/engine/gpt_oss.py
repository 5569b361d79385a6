"""What gpt-oss (`GptOssForCausalLM`) adds to the shared decoder (`engine.llama`): its checkpoint
tensors, attention sinks, and its expert MLP (`GptOssMoe`).

The rest of a gpt-oss layer is the Llama layer with biases on q/k/v/o: per-layer windows are
`ModelConfig.layer_windows` and reach the attention backends as `window=`, the sinks as `sinks=`,
YaRN is `layers.yarn_inv_freq`, and MXFP4 experts are dequantized by the loader (`engine.mxfp4`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.layers import Linear
from pdserve.engine.model_config import ClampedSwiglu, ModelConfig
from pdserve.engine.moe_config import MoeConfig
from pdserve.engine.moe import Expert, SparseMoe

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
"""One layer's experts, each tensor over all of them (`mlp.experts.<name>`), as transformers 5 and the
openai/gpt-oss checkpoints store them: gate_up_proj [E, H, 2I] (gate and up interleaved along 2I),
down_proj [E, I, H], their biases [E, 2I] and [E, H]."""


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """The checkpoint tensors of gpt-oss decoder layer `layer` (an MXFP4 checkpoint holds the two
    expert weights as `_blocks` and `_scales`, which the loader reads in their place)."""
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.sinks"]
    kinds = ("weight", "bias") if config.attention_bias else ("weight",)
    names += [p + f"self_attn.{x}_proj.{kind}" for x in "qkvo" for kind in kinds]
    names += [p + "mlp.router.weight", p + "mlp.router.bias"]
    return names + [p + "mlp.experts." + name for name in EXPERT_TENSORS]


def _take(t: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Pop tensor `name`, refused by name unless it has `shape`."""
    tensor = t.pop(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {list(tensor.shape)}; the config asks for {list(shape)}")
    return tensor


def load_sinks(config: ModelConfig, t: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """Layer `layer`'s sinks [Hq], one logit per query head (wrong shape: ValueError naming it)."""
    return _take(t, f"model.layers.{layer}.self_attn.sinks", (config.num_attention_heads,))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> [T, I]: gpt-oss's activation, in transformers' order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoe(SparseMoe):
    """gpt-oss's expert MLP: the router has a bias, and each token's top-k experts by logit are
    weighted by a softmax over those k logits only, in the model's dtype (transformers'
    GptOssTopKRouter); experts have biases and gate with `clamped_swiglu`, not SiLU.

    Dispatch, expert order and the scatter are SparseMoe's (the same exactness argument); only the
    one-by-one expert loop runs, since the grouped CUDA GEMMs carry no biases."""

    def __init__(
        self,
        config: MoeConfig,
        router: torch.Tensor,
        router_bias: torch.Tensor,
        experts: dict[int, Expert],
        swiglu: ClampedSwiglu,
    ) -> None:
        super().__init__(config, router, experts)
        self.router_bias = router_bias
        self.swiglu = swiglu

    @classmethod
    def load(cls, config: ModelConfig, t: dict[str, torch.Tensor], layer: int, prepack: bool) -> GptOssMoe:
        """Layer `layer`'s router and experts, popped from `t`. The checkpoint's gate_up [E, H, 2I]
        has gate at even and up at odd columns: each expert's becomes one [2I, H] Linear, gate rows
        then up rows (its bias likewise), so one GEMM still computes both.

        `config` is this process's share (`TPShard.local_config`): I its part of each expert's width,
        and under expert parallelism the expert tensors hold only `moe.expert_range`, keyed here by
        their global ids (experts of other ranks are absent: SparseMoe's rows for them stay zero).
        The router is whole: every rank routes every token."""
        moe, swiglu = config.moe, config.swiglu
        assert moe is not None and swiglu is not None
        first, stop = moe.expert_range or (0, moe.num_experts)
        e, h, i = stop - first, config.hidden_size, moe.intermediate_size
        p = f"model.layers.{layer}.mlp."
        gate_up = _take(t, p + "experts.gate_up_proj", (e, h, 2 * i))
        gate_up_bias = _take(t, p + "experts.gate_up_proj_bias", (e, 2 * i))
        down = _take(t, p + "experts.down_proj", (e, i, h))
        down_bias = _take(t, p + "experts.down_proj_bias", (e, h))
        experts = {}
        for x in range(e):
            weight = torch.cat([gate_up[x, :, 0::2].T, gate_up[x, :, 1::2].T])
            bias = torch.cat([gate_up_bias[x, 0::2], gate_up_bias[x, 1::2]])
            experts[first + x] = Expert(
                Linear(weight, bias, prepack=prepack),
                Linear(down[x].T.contiguous(), down_bias[x].contiguous(), prepack=prepack),
            )
        router = _take(t, p + "router.weight", (moe.num_experts, h))
        return cls(moe, router, _take(t, p + "router.bias", (moe.num_experts,)), experts, swiglu)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, k] in h's dtype, expert ids [T, k]): top-k of the biased router
        logits, then a softmax over those k."""
        logits = F.linear(h, self.router, self.router_bias)
        top, ids = torch.topk(logits, self.config.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def forward(self, h: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """As SparseMoe's, with the clamped SwiGLU in place of the decoder's `silu_mul`."""
        return super().forward(h, self._activation)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.swiglu.alpha, self.swiglu.limit)

    def _grouped_usable(self, h: torch.Tensor) -> bool:
        return False  # TODO(speed): add the expert biases to the grouped GEMMs' rows
