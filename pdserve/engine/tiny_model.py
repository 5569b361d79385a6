"""Deterministic built-in checkpoints in real Hugging Face format (random weights, trained BPE).

`make_tiny_model(dir, size, arch=..., fp8=...)` writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with a ChatML chat template), generation_config.json and
special_tokens_map.json, for any served architecture (ARCHS), optionally FP8 block-quantized as
Qwen3-*-FP8 checkpoints are. The weights are random but seeded, so every build is byte-identical;
they are loaded by the same code path as any real checkpoint (and by transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS, IM_END, pad_tokenizer, train_tokenizer

if TYPE_CHECKING:  # torch is imported where weights are made: `pdserve --help` lists ARCHS without it
    import torch

SIZES: dict[str, dict[str, Any]] = {  # config.json values (vocab_size None: fitted to the tokenizer)
    # tiny: loads in milliseconds; used by tests and `pdserve up` by default
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
        max_position_embeddings=4096,
    ),
    # bench: ~110M parameters, for benchmarks
    "bench": dict(
        hidden_size=768,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}


ARCHS: dict[str, dict[str, Any]] = {  # config.json values of each architecture over a size's dimensions
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=512),
    # head_dim 64 on both sizes: not hidden_size / heads (32 on tiny), as in real Qwen3 configs
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=64),
    "qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8, num_experts_per_tok=2
    ),
}
DEEPSEEK_MOE = dict(  # 8 routed experts in 4 groups, top-2 from the best 2 groups, a dense first layer
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, moe_layer_freq=1
)
ARCHS["deepseek-v2"] = dict(  # V2's q LoRA-less layout (as V2-Lite), softmax routing in groups, 2 shared experts
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    topk_method="group_limited_greedy",
    scoring_func="softmax",
    n_shared_experts=2,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    **DEEPSEEK_MOE,
)
ARCHS["deepseek-v3"] = dict(  # V3: q LoRA, sigmoid scores with a correction bias, one shared expert
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    n_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    **DEEPSEEK_MOE,
)
"""`--arch`: the Llama family, Qwen3, the mixture-of-experts Qwen3-MoE and Mixtral (8 experts, top-2),
and DeepSeek-V2/V3 (latent attention, 8 routed experts in groups plus shared ones)."""
ARCHS["gpt-oss"] = dict(  # sinks, sliding and full layers alternating, 8 biased experts (top-2), YaRN
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    attention_bias=True,
    num_local_experts=8,
    num_experts_per_tok=2,
    swiglu_limit=7.0,
    rope_theta=150000.0,
    rope_scaling=dict(  # as openai/gpt-oss's config.json, over a quarter of tiny's 4096 positions
        rope_type="yarn",
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=1024,
    ),
)
GPT_OSS_WINDOW = {"tiny": 16, "bench": 128}
"""gpt-oss's sliding window per size: 16 keys on tiny, so that test prompts of ~70 tokens outgrow it."""
MLA_DIMS = {
    "tiny": dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=48),
    # DeepSeek-V2/V3's own attention dims (a latent of 512 + 64 values per token and layer), which
    # vLLM's CPU MLA also runs (it takes latents of 320, 512 or 576 values only)
    "bench": dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=384),
}
"""Latent attention dims of the DeepSeek archs per size (`q_lora_rank` on V3 only)."""

FP8_BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
"""`quantization_config` of an FP8 checkpoint: float8_e4m3fn weights, one float32 scale per 128x128 block."""


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights. lm_head gets a larger scale than usual so greedy decoding has
    clear top-1 margins (exactness tests compare greedy ids across batchings)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    std = h**-0.5

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def mlp(prefix: str, names: tuple[str, str, str], width: int) -> None:
        t[f"{prefix}{names[0]}.weight"] = rand(width, h)
        t[f"{prefix}{names[1]}.weight"] = rand(width, h)
        t[f"{prefix}{names[2]}.weight"] = rand(h, width, scale=width**-0.5 / layers**0.5)

    t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h, scale=1.0)}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    mixtral = cfg["model_type"] == "mixtral"
    for i in range(layers):
        p = f"model.layers.{i}."
        if cfg.get("kv_lora_rank"):
            _mla_weights(t, cfg, p + "self_attn.", rand)
            _deepseek_mlp(t, cfg, i, p + "mlp.", rand, mlp)
            t[p + "input_layernorm.weight"] = torch.ones(h)
            t[p + "post_attention_layernorm.weight"] = torch.ones(h)
            continue
        t[p + "self_attn.q_proj.weight"] = rand(hq * d, h)
        t[p + "self_attn.k_proj.weight"] = rand(hkv * d, h)
        t[p + "self_attn.v_proj.weight"] = rand(hkv * d, h)
        if cfg.get("attention_bias"):
            for x, n in (("q", hq), ("k", hkv), ("v", hkv)):
                t[p + f"self_attn.{x}_proj.bias"] = rand(n * d, scale=0.1)
        if cfg["model_type"].startswith("qwen3"):  # per-head q/k norms, not all ones
            t[p + "self_attn.q_norm.weight"] = 1.0 + rand(d, scale=0.1)
            t[p + "self_attn.k_norm.weight"] = 1.0 + rand(d, scale=0.1)
        t[p + "self_attn.o_proj.weight"] = rand(h, hq * d, scale=std / layers**0.5)
        if experts:
            moe = p + ("block_sparse_moe." if mixtral else "mlp.")
            width = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
            t[moe + "gate.weight"] = rand(experts, h, scale=1.0)  # clear routing margins
            for e in range(experts):
                mlp(
                    f"{moe}experts.{e}.",
                    ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"),
                    width,
                )
        else:
            mlp(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), inter)
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    t["model.norm.weight"] = torch.ones(h)
    t["lm_head.weight"] = rand(cfg["vocab_size"], h, scale=3.0 * std)
    return t


def _mla_weights(t: dict, cfg: dict, p: str, rand: Any) -> None:
    """One DeepSeek attention block: the q (LoRA or not), latent and up-projections, and non-trivial
    latent norms."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    lora, latent = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    if lora is None:
        t[p + "q_proj.weight"] = rand(hq * qk, h)
    else:
        t[p + "q_a_proj.weight"] = rand(lora, h)
        t[p + "q_a_layernorm.weight"] = 1.0 + rand(lora, scale=0.1)
        t[p + "q_b_proj.weight"] = rand(hq * qk, lora, scale=lora**-0.5)
    t[p + "kv_a_proj_with_mqa.weight"] = rand(latent + cfg["qk_rope_head_dim"], h)
    t[p + "kv_a_layernorm.weight"] = 1.0 + rand(latent, scale=0.1)
    t[p + "kv_b_proj.weight"] = rand(hq * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), latent, scale=latent**-0.5)
    t[p + "o_proj.weight"] = rand(h, hq * cfg["v_head_dim"], scale=(hq * cfg["v_head_dim"]) ** -0.5)


def _deepseek_mlp(t: dict, cfg: dict, i: int, p: str, rand: Any, mlp: Any) -> None:
    """Layer i's DeepSeek MLP: dense below `first_k_dense_replace`, else routed experts, a router
    (and V3's score correction bias) and the shared experts."""
    names = ("gate_proj", "up_proj", "down_proj")
    if i < cfg["first_k_dense_replace"]:
        mlp(p, names, cfg["intermediate_size"])
        return
    experts, width = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    t[p + "gate.weight"] = rand(experts, cfg["hidden_size"], scale=1.0)
    if cfg["topk_method"] == "noaux_tc":
        t[p + "gate.e_score_correction_bias"] = rand(experts, scale=0.1)
    for e in range(experts):
        mlp(f"{p}experts.{e}.", names, width)
    mlp(p + "shared_experts.", names, width * cfg["n_shared_experts"])


def _gpt_oss_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random gpt-oss weights in its checkpoint layout (`engine.gpt_oss.EXPERT_TENSORS`):
    biased q/k/v/o and experts, random sinks, a biased router with clear margins, and gate/up
    weights large enough that the SwiGLU's clamp at `swiglu_limit` is reached by some values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    std = h**-0.5

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h, scale=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for x, n in (("q", hq), ("k", hkv), ("v", hkv)):
            t[p + f"self_attn.{x}_proj.weight"] = rand(n * d, h)
            t[p + f"self_attn.{x}_proj.bias"] = rand(n * d, scale=0.1)
        t[p + "self_attn.o_proj.weight"] = rand(h, hq * d, scale=std / layers**0.5)
        t[p + "self_attn.o_proj.bias"] = rand(h, scale=0.1)
        t[p + "self_attn.sinks"] = rand(hq, scale=1.0)
        t[p + "mlp.router.weight"] = rand(e, h, scale=1.0)
        t[p + "mlp.router.bias"] = rand(e, scale=0.1)
        t[p + "mlp.experts.gate_up_proj"] = rand(e, h, 2 * inter, scale=3.0 * std)
        t[p + "mlp.experts.gate_up_proj_bias"] = rand(e, 2 * inter, scale=0.1)
        t[p + "mlp.experts.down_proj"] = rand(e, inter, h, scale=inter**-0.5 / layers**0.5 / 4)
        t[p + "mlp.experts.down_proj_bias"] = rand(e, h, scale=0.1)
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    t["model.norm.weight"] = torch.ones(h)
    t["lm_head.weight"] = rand(cfg["vocab_size"], h, scale=3.0 * std)
    return t


def quantize_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every linear projection's weight as float8_e4m3fn plus a `weight_scale_inv` per 128x128 block
    (amax / 448, as FP8 checkpoints are made); embeddings, norms, routers and the LM head stay as
    they are, as in Qwen3-*-FP8."""
    import torch

    fmax = torch.finfo(torch.float8_e4m3fn).max
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not name.endswith(("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            out[name] = w
            continue
        n, k = w.shape
        bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        padded = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK)
        padded[:n, :k] = w
        blocks = padded.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
        q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).view(bn * FP8_BLOCK, bk * FP8_BLOCK)
        out[name] = q[:n, :k].to(torch.float8_e4m3fn).contiguous()
        out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale.float()
    return out


def make_tiny_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    vocab_size: int | None = None,
    arch: str = "llama",
    fp8: bool = False,
) -> Path:
    """Write the built-in checkpoint `size` ("tiny" or "bench") of architecture `arch` (ARCHS) into
    out_dir; `vocab_size` replaces the size's vocabulary (a wider LM head: the pipeline tests' phase
    split); `fp8`: FP8 block-quantized linear weights (`quantize_fp8`)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    spec = dict(SIZES[size], **({"vocab_size": vocab_size} if vocab_size else {}))
    real_vocab = tok.get_vocab_size(with_added_tokens=True)
    spec["vocab_size"] = spec["vocab_size"] or (real_vocab + 63) // 64 * 64  # padded like real checkpoints
    tok = pad_tokenizer(tok, spec["vocab_size"])  # every model id decodes to text
    bos, eos, im_end = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(IM_END)
    config = {
        **spec,
        "head_dim": spec["hidden_size"] // spec["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": [eos, im_end],
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        **ARCHS[arch],
    }
    if arch == "qwen3-moe":  # each expert a quarter of the dense width: 8 experts, top-2
        config["moe_intermediate_size"] = spec["intermediate_size"] // 4
    elif arch == "mixtral":
        config["intermediate_size"] = spec["intermediate_size"] // 4
    elif arch.startswith("deepseek"):
        dims = dict(MLA_DIMS[size])
        lora = dims.pop("q_lora_rank")
        config.update(dims, q_lora_rank=lora if arch == "deepseek-v3" else None)
        config["moe_intermediate_size"] = spec["intermediate_size"] // 4
        del config["head_dim"]  # MLA heads are qk_nope + qk_rope wide; transformers derives its own
        config["num_key_value_heads"] = config["num_attention_heads"]  # as in DeepSeek's configs
    elif arch == "gpt-oss":  # experts a quarter of the dense width; windowed layers 0, 2, ...
        if fp8:
            raise ValueError("gpt-oss is not built FP8-quantized (its checkpoints quantize experts to MXFP4)")
        config["intermediate_size"] = spec["intermediate_size"] // 4
        config["sliding_window"] = GPT_OSS_WINDOW[size]
        layers = range(spec["num_hidden_layers"])
        config["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in layers]
    if fp8:
        config["quantization_config"] = dict(FP8_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen_config = {"bos_token_id": bos, "eos_token_id": [eos, im_end], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": EOS,
        "add_bos_token": True,
        "model_max_length": spec["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": IM_END, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    from safetensors.torch import save_file

    tensors = _gpt_oss_weights(config, seed) if arch == "gpt-oss" else _weights(config, seed)
    save_file(quantize_fp8(tensors) if fp8 else tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
