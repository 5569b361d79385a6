from __future__ import annotations

from engine.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer

TEXT = "Héllo wörld 🙂🚀 你好，世界。こんにちは 😀 done"


def test_matches_transformers_encode_and_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir)
    assert tok.encode(TEXT) == hf(TEXT)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_chat(messages) == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                               return_dict=False)


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
