"""Small checkpoints for exactness tests, built with transformers on random weights."""

from __future__ import annotations

from pathlib import Path

import torch


def build_checkpoint(kind: str, out_dir: Path, tokenizer_src: Path) -> Path:
    """A random transformers checkpoint of `kind` (gqa | mqa | qwen2 | llama3 | mistral, the last
    with a sliding window of 32; mqa has one KV head, fewer than any tensor-parallel degree) using
    the tiny model's tokenizer."""
    import shutil

    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
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
    else:
        raise ValueError(kind)
    torch.manual_seed(1234)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear margins
        head = model.lm_head.weight if not cfg.tie_word_embeddings else model.model.embed_tokens.weight
        head.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, out_dir / name)
    return out_dir
