"""Small checkpoints for exactness tests, built with transformers on random weights."""

from __future__ import annotations

from pathlib import Path

import torch


def build_checkpoint(kind: str, out_dir: Path, tokenizer_src: Path) -> Path:
    """A random transformers checkpoint of `kind` (gqa | mqa | qwen2 | llama3 | mistral, the last
    with a sliding window of 32; mqa has one KV head, fewer than any tensor-parallel degree; and the
    newer architectures in NEW_KINDS) using the tiny model's tokenizer."""
    import shutil

    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=2048,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        max_position_embeddings=1024,
    )
    if kind == "gqa":
        cfg, cls = LlamaConfig(num_key_value_heads=2, **common), LlamaForCausalLM
    elif kind == "mqa":
        cfg, cls = LlamaConfig(num_key_value_heads=1, **common), LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = Qwen2Config(num_key_value_heads=3, tie_word_embeddings=True, **common), Qwen2ForCausalLM
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg, cls = LlamaConfig(num_key_value_heads=3, rope_scaling=rope, rope_theta=50000.0, **common), LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = MistralConfig(num_key_value_heads=2, sliding_window=32, **common), MistralForCausalLM
    elif kind in ("qwen3", "qwen3-tied"):  # head_dim 40: q is 240 wide on a hidden size of 96
        qwen3 = dict(common, num_key_value_heads=2, head_dim=40, tie_word_embeddings=kind == "qwen3-tied")
        cfg, cls = Qwen3Config(**qwen3), Qwen3ForCausalLM
    elif kind in ("qwen3-moe", "qwen3-moe-mixed"):
        moe = dict(common, num_key_value_heads=2, head_dim=24, num_experts=6, num_experts_per_tok=2)
        moe.update(moe_intermediate_size=40)
        if kind == "qwen3-moe-mixed":  # sparse every other layer (1, 3, 5) but layer 3 (mlp_only_layers)
            moe.update(num_hidden_layers=6, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])
        cfg, cls = Qwen3MoeConfig(**moe), Qwen3MoeForCausalLM
    elif kind == "mixtral":
        mix = dict(common, intermediate_size=48, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
        cfg, cls = MixtralConfig(sliding_window=32, **mix), MixtralForCausalLM
    elif kind in ("gpt-oss", "gpt-oss-tp"):  # -tp: experts 96 wide, 48 a rank of two (not a multiple of 32)
        width = 96 if kind == "gpt-oss-tp" else 64
        gpt_oss = dict(common, num_hidden_layers=4, intermediate_size=width)
        cfg, cls = GptOssConfig(**GPT_OSS, **gpt_oss), GptOssForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(1234)
    model = cls(cfg).to(torch.float32)
    if cfg.model_type in ("qwen3", "qwen3_moe"):  # norms that are not all ones, so a skipped one shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if cfg.model_type == "gpt_oss":
        _spread_gpt_oss(model)
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear margins
        head = model.lm_head.weight if not cfg.tie_word_embeddings else model.model.embed_tokens.weight
        head.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, out_dir / name)
    return out_dir


GPT_OSS = dict(
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=16,
    # not the default alternation: two full layers in a row, windowed first and last layers
    layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 256,
    },
)
"""gpt-oss of the factory's sizes: 16-key windows on layers 0 and 3, 6 experts (top-2) of width 64
(a multiple of MXFP4's 32-value blocks, as the hidden size 96 is), YaRN over 256 original positions."""


def _spread_gpt_oss(model) -> None:
    """Weights that make every gpt-oss feature count: sinks of the size of the scores, q/k/v/o
    biases, router margins, and gate/up values past the SwiGLU's clamp (7) for some tokens."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.sinks.normal_(0.0, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0.0, 0.1)
            mlp.router.weight.normal_(0.0, 0.5)
            mlp.router.bias.normal_(0.0, 0.1)
            mlp.experts.gate_up_proj.normal_(0.0, 0.4)
            mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            mlp.experts.down_proj.normal_(0.0, 0.05)
            mlp.experts.down_proj_bias.normal_(0.0, 0.1)


NEW_KINDS = ["qwen3", "qwen3-tied", "qwen3-moe", "qwen3-moe-mixed", "mixtral", "gpt-oss"]
"""Qwen3 (untied, tied), Qwen3-MoE (all layers sparse; dense and sparse mixed with norm_topk_prob),
Mixtral (with a sliding window of 32), gpt-oss (`GPT_OSS`: sinks, per-layer windows of 16, YaRN)."""


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt`: (`new_tokens` ids, log-softmax of each step's
    logits [new_tokens, vocab] in float32)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1)


def hf_model(model_dir, dtype: torch.dtype = torch.float32):
    """transformers' model of a checkpoint, for reference outputs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def random_prompts(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """`n` seeded prompts of 3-69 random ids (after `prefix`)."""
    import random

    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 1700) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def assert_greedy_matches(hf, llm, prompts: list[list[int]], new_tokens: int, atol: float) -> None:
    """The engine's greedy ids equal transformers' and its logprobs are within `atol`, for every
    prompt; afterwards the engine is consistent and every KV block is free again."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids, ref = hf_greedy(hf, prompt, new_tokens)
        comp = out.outputs[0]
        assert comp.token_ids == ids, (prompt[:8], comp.token_ids, ids)
        got = torch.tensor([lp.logprob for lp in comp.logprobs])
        want = ref[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def add_remote(engine, request_id: str, prompt: list[int], params) -> list[int]:
    """Admit a request as a decode node that offers it to a prefill node does (the engine's connector
    is a `RemotePrefillPolicy`, by default never local): its blocks, parked for the remote KV."""
    from pdserve.engine.remote_prefill import DO_REMOTE_PREFILL

    source = engine.add_request(request_id, prompt, params, kv_transfer_params={DO_REMOTE_PREFILL: True})
    assert source.location == "remote", source
    return source.block_ids
