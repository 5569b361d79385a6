"""Deterministic built-in checkpoints in real Hugging Face format (random weights, trained BPE).

`make_tiny_model(dir, size)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a ChatML chat template), generation_config.json and
special_tokens_map.json. The weights are random but seeded, so every build is
byte-identical; they are loaded by the same code path as any real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

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


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Byte-level BPE trained on engine/data/corpus.txt (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n"), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def pad_tokenizer(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Grow the BPE vocabulary to exactly `vocab_size` ids, deterministically.

    The corpus yields fewer merges than a model's vocabulary (1,761 vs 32,000 for
    `bench`), and an id the tokenizer does not know decodes to empty text, so a
    client streaming random-weight output would see empty chunks. The new ids are
    two-word phrases (" the" + " model" -> " the model") added to the vocabulary
    without merges: encoding never produces them, decoding gives readable text.
    """
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    have = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < have:
        raise ValueError(f"vocab_size {vocab_size} is below the trained tokenizer's {have} ids")
    # "Ġ" is the byte-level alphabet's space: word-initial tokens of letters only, by id
    words = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t[:1] == "Ġ" and t[1:].isalpha()]
    next_id = have
    for first in words:
        for second in words:
            if next_id == vocab_size:
                break
            phrase = first + second
            if phrase not in vocab:
                vocab[phrase] = next_id
                next_id += 1
    assert next_id == vocab_size, f"only {next_id} ids from {len(words)} words; need {vocab_size}"
    return Tokenizer.from_str(json.dumps(data))


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights. lm_head gets a larger scale than usual so greedy decoding has
    clear top-1 margins (exactness tests compare greedy ids across batchings)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // hq
    std = h**-0.5

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h, scale=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(hq * d, h)
        t[p + "self_attn.k_proj.weight"] = rand(hkv * d, h)
        t[p + "self_attn.v_proj.weight"] = rand(hkv * d, h)
        t[p + "self_attn.o_proj.weight"] = rand(h, hq * d, scale=std / layers**0.5)
        t[p + "mlp.gate_proj.weight"] = rand(inter, h)
        t[p + "mlp.up_proj.weight"] = rand(inter, h)
        t[p + "mlp.down_proj.weight"] = rand(h, inter, scale=inter**-0.5 / layers**0.5)
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    t["model.norm.weight"] = torch.ones(h)
    t["lm_head.weight"] = rand(cfg["vocab_size"], h, scale=3.0 * std)
    return t


def make_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, vocab_size: int | None = None) -> Path:
    """Write the built-in checkpoint `size` ("tiny" or "bench") into out_dir; `vocab_size` replaces
    the size's vocabulary (a wider LM head: the pipeline tests' phase split)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    spec = dict(SIZES[size], **({"vocab_size": vocab_size} if vocab_size else {}))
    real_vocab = tok.get_vocab_size(with_added_tokens=True)
    spec["vocab_size"] = spec["vocab_size"] or (real_vocab + 63) // 64 * 64  # padded like real checkpoints
    tok = pad_tokenizer(tok, spec["vocab_size"])  # every model id decodes to text
    bos, eos, im_end = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(IM_END)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
    }
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
    save_file(_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
