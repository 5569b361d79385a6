from __future__ import annotations

from pathlib import Path

from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer

TEXT = "Héllo wörld 🙂🚀 你好，世界。こんにちは 😀 done"


def test_matches_transformers_encode_and_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir)
    assert tok.encode(TEXT) == hf(TEXT)["input_ids"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )
    assert tok.encode_chat(messages) == hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_incremental_detokenizer_never_emits_partial_characters(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i, t in enumerate(ids):
        delta = detok.add([t])
        assert "\ufffd" not in delta
        pieces.append(delta)
        assert TEXT.startswith(detok.text)
    assert "".join(pieces) == TEXT == detok.text


def test_stop_string_checker_truncates(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    for include, expected in [(False, "The quick "), (True, "The quick brown")]:
        checker = StopStringChecker(IncrementalDetokenizer(tok), ("brown",), include)
        hit = [checker.check(t) for t in ids]
        assert any(hit) and checker.truncated_text == expected


def test_every_model_token_id_decodes_to_text(tiny_model_dir):
    """The built-in tokenizer covers the model's whole vocabulary (no id decodes to nothing)."""
    import json

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(tiny_model_dir)
    assert tok.vocab_size == vocab
    special = {
        tok.encode(s, add_special_tokens=False)[0]
        for s in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
    }
    empty = [i for i in range(vocab) if i not in special and tok.decode([i]) == ""]
    assert empty == []


def test_tokenizer_padding_is_deterministic_and_exact():
    from pdserve.engine.tiny_tokenizer import pad_tokenizer, train_tokenizer

    a, b = pad_tokenizer(train_tokenizer(), 3000), pad_tokenizer(train_tokenizer(), 3000)
    assert a.to_str() == b.to_str() and a.get_vocab_size(with_added_tokens=True) == 3000


def test_the_built_in_models_cache_key_covers_the_tokenizer_module(tmp_path, monkeypatch):
    """The tokenizer is written by its own module: editing it must give the built-in models a new
    cache directory, as editing tiny_model.py does."""
    from pdserve.engine import builtin, tiny_tokenizer

    before = builtin.source_digest()
    edited = tmp_path / "tiny_tokenizer.py"
    edited.write_bytes(Path(tiny_tokenizer.__file__).read_bytes() + b"# edited\n")
    monkeypatch.setattr(tiny_tokenizer, "__file__", str(edited))
    assert builtin.source_digest() != before


def test_cut_at_stop_is_the_one_stop_string_rule():
    """Engine checker, offline LLM text and the router's stream all cut with engine.tokenizer.cut_at_stop."""
    from pdserve.engine.tokenizer import cut_at_stop

    assert cut_at_stop("a cat. a dog.", ("dog", "."), include=False) == "a cat"  # the earliest match wins
    assert cut_at_stop("a cat. a dog.", ("dog", "."), include=True) == "a cat."
    assert cut_at_stop("a cat. a dog.", (".",), include=False, start=6) == "a cat. a dog"
    assert cut_at_stop("abc", ("ab", "a"), include=True) == "ab"  # a tie goes to the first listed
    assert cut_at_stop("abc", ("x",), include=False) is None
    assert cut_at_stop("abc", (), include=False) is None
