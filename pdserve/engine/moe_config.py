"""MoeConfig: the expert MLP of a mixture-of-experts checkpoint (Qwen3-MoE, Mixtral, DeepSeek-V2/V3,
gpt-oss), read from its config.json keys by `ModelConfig.from_dict`.

A routing function, expert layout or shared expert pdserve does not run is refused at start with
its config key named (`ValueError`), never served wrong."""

from __future__ import annotations

from dataclasses import dataclass

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
"""The expert MLPs `parse_moe` reads (DeepSeek's: `parse_deepseek_moe`, gpt-oss's: `parse_gpt_oss_moe`)."""


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
    scoring: str = "softmax"
    """Router scores: `softmax` over all experts, or DeepSeek-V3's `sigmoid` per expert."""
    topk_method: str = "greedy"
    """`greedy` top-k; DeepSeek-V2's `group_limited_greedy` (the `topk_group` groups of highest
    max score, then top-k inside them); DeepSeek-V3's `noaux_tc` (groups ranked by the sum of their
    two best bias-corrected scores; experts chosen by the corrected scores, weighted by the raw ones)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek)."""
    shared_intermediate_size: int = 0
    """Width of the shared expert MLP every token runs besides its routed ones (DeepSeek's
    `n_shared_experts * moe_intermediate_size`); 0: none."""
    first_k_dense_replace: int = 0
    """Layers below this index run a dense MLP of the model's `intermediate_size` (DeepSeek)."""
    router_float32: bool = False
    """The router GEMM runs in float32 on float32 weights (DeepSeek keeps its gate in float32)."""
    expert_range: tuple[int, int] | None = None
    """[start, stop) of the experts this process holds under expert parallelism (set by
    `TPShard.local_config`: gpt-oss's fused expert tensors arrive sliced to them); None: all."""

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (global index) has the expert MLP."""
        if layer < self.first_k_dense_replace or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0


def parse_moe(arch: str, raw: dict) -> MoeConfig | None:
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


def parse_deepseek_moe(arch: str, raw: dict) -> MoeConfig | None:
    """DeepSeek's expert MLP: routed experts (`n_routed_experts`) with grouped top-k, plus shared
    experts; every key it routes by is checked, an unknown method refused by name."""
    experts = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts")
    if not experts:
        return None  # a dense DeepSeek (no routed experts): every layer runs the dense MLP
    experts = int(experts)
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    served = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
    if scoring not in served:
        raise ValueError(f"scoring_func {scoring!r} is not supported: pdserve serves softmax and sigmoid")
    if method not in served[scoring]:
        raise ValueError(
            f"topk_method {method!r} is not supported with scoring_func {scoring!r}: "
            f"pdserve serves {', '.join(served[scoring])} there"
        )
    top_k, groups = int(raw.get("num_experts_per_tok") or 0), int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or 1)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and n_routed_experts={experts}")
    if experts % groups or not 1 <= topk_group <= groups:
        raise ValueError(f"n_group={groups} must divide n_routed_experts={experts} and hold topk_group={topk_group}")
    if method != "greedy" and top_k > topk_group * (experts // groups):
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups")
    if int(raw.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError(
            f"moe_layer_freq={raw['moe_layer_freq']} is not supported: only 1 (every layer after the dense ones)"
        )
    width = raw.get("moe_intermediate_size")
    if not width:
        raise ValueError(f"{arch} needs moe_intermediate_size")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(width),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        float32_weights=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        scoring=scoring,
        topk_method=method,
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0) or 1.0),
        shared_intermediate_size=int(raw.get("n_shared_experts") or 0) * int(width),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        router_float32=True,
    )


def parse_gpt_oss_moe(raw: dict) -> MoeConfig:
    """gpt-oss's experts: every layer sparse, `num_local_experts` of `intermediate_size` each, top
    `num_experts_per_tok` (transformers' default 4) by router logit, weighted by a softmax over those."""
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if experts < 1:
        raise ValueError(f"GptOssForCausalLM needs a positive num_local_experts, got {experts}")
    top_k = int(raw.get("num_experts_per_tok") or 4)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={experts}")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,  # a softmax over the top-k logits: the weights sum to 1
        float32_weights=False,  # routing weights in the model's dtype, as transformers' router
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )
