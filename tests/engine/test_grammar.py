"""Structured outputs in the engine: specs checked and built, the compile cache bounded, grammars
that mask the sampler and end the request, the prefill node's first token replayed on the decode
side, and a clear ValueError (never a crash) without xgrammar or with a bad spec."""

from __future__ import annotations

import json
import re
import sys

import pytest

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.grammar import (
    GrammarSpec,
    GrammarUnavailable,
    bounded_strings_as_patterns,
    build_grammar,
    choice_ebnf,
)
from pdserve.engine.grammar_cache import GrammarCache
from pdserve.engine.remote_prefill import RemotePrefillPolicy
from pdserve.engine.tokenizer import Tokenizer
from tests.engine.factories import add_remote

pytest.importorskip("xgrammar")
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["x", "y"]}},
    "required": ["n", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_kv_blocks=256)


@pytest.mark.parametrize(
    "spec, why",
    [
        (GrammarSpec("yaml", "x"), "kind must be one of"),
        (GrammarSpec("json_schema", "{"), "not JSON"),
        (GrammarSpec("json_schema", '{"type": "nosuch"}'), "invalid json_schema: .*nosuch"),
        (GrammarSpec("regex", "(("), "invalid regex: .*parenthesis"),
        (GrammarSpec("regex", ""), "must not be empty"),
        (GrammarSpec("choice", '["a", 3]'), "list of 1 to"),
        (GrammarSpec("grammar", "root ::= "), "invalid grammar"),
        (GrammarSpec("json_object", "{}"), "takes no spec"),
        (GrammarSpec("regex", "a" * 70000), "at most 65536 bytes"),
    ],
)
def test_a_bad_spec_is_a_value_error_that_says_why(spec, why) -> None:
    with pytest.raises(ValueError, match=why):
        build_grammar(spec)


def test_sampling_params_check_the_spec_shape() -> None:
    with pytest.raises(ValueError, match="structured_outputs: .*kind"):
        SamplingParams(structured_outputs=GrammarSpec("yaml", "x"))
    assert SamplingParams(structured_outputs=("regex", "a")).structured_outputs == GrammarSpec("regex", "a")


def test_without_xgrammar_a_structured_request_is_refused_not_crashed(llm, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(GrammarUnavailable, match="xgrammar, which is not installed"):
        build_grammar(GrammarSpec("regex", "a"))
    engine = llm.engine
    with pytest.raises(ValueError, match="not installed"):
        engine.add_request("nox", [5, 6], SamplingParams(structured_outputs=GrammarSpec("regex", "[a-z]{9}")))
    assert "nox" not in engine.requests
    assert llm.generate([5, 6], SamplingParams(max_tokens=3))[0].outputs[0].token_ids  # free text still runs


def test_choice_ebnf_escapes_and_dedups() -> None:
    assert choice_ebnf(json.dumps(['say "hi"', "a\\b", 'say "hi"'])) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


def test_length_bounded_strings_become_patterns() -> None:
    out = bounded_strings_as_patterns({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    pattern = out["properties"]["s"]["pattern"]
    assert re.fullmatch(pattern, "abc") and not re.fullmatch(pattern, "abcd") and not re.fullmatch(pattern, "a\x16")
    kept = {"type": "string", "maxLength": 3, "pattern": "^a+$"}
    assert bounded_strings_as_patterns(kept) == kept


def test_the_compile_cache_is_bounded_and_keyed_by_spec(tiny_model_dir) -> None:
    tok = Tokenizer(tiny_model_dir)
    cache = GrammarCache(tok, tok.vocab_size, tok.eos_token_ids, max_compiled=2)
    first = cache.compile(GrammarSpec("regex", "a+"))
    assert cache.compile(GrammarSpec("regex", "a+")) is first  # a hit
    cache.compile(GrammarSpec("regex", "b+"))
    cache.compile(GrammarSpec("regex", "c+"))
    assert len(cache._compiled) == 2 and cache.compile(GrammarSpec("regex", "a+")) is not first  # evicted


def test_outputs_match_and_finish_with_stop(llm) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=3, min_tokens=2, structured_outputs=spec)
    outs = llm.generate(["a", "b c", "The model", "x y z"], params)
    for out in outs:
        value = json.loads(out.outputs[0].text)
        assert value["c"] in ("x", "y") and 0 <= value["n"] <= 9 and set(value) == {"n", "c"}
        assert out.outputs[0].finish_reason == "stop"
    choice = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=GrammarSpec("choice", '["up", "down"]'))
    assert llm.generate("x", choice)[0].outputs[0].text in ("up", "down")
    llm.engine.check_integrity()


def test_the_decode_side_replays_the_first_token_and_refuses_one_the_grammar_forbids(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(tiny_model_dir, num_kv_blocks=64), connector=RemotePrefillPolicy())
    spec = GrammarSpec("regex", "[0-9]+")
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=spec)
    digit, letter = engine.tokenizer.encode("7", add_special_tokens=False)[0], engine.tokenizer.encode("q")[-1]
    add_remote(engine, "bad", [5, 6, 7], params)
    with pytest.raises(ValueError, match="breaks the request's grammar"):
        engine.complete_remote_prefill("bad", letter)
    engine.abort("bad")
    add_remote(engine, "ok", [5, 6, 7], params)
    engine.complete_remote_prefill("ok", digit)
    tokens = [digit]
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    text = engine.tokenizer.decode(tokens)
    assert re.fullmatch("[0-9]+", text), text
    engine.check_integrity()
    assert not engine.requests


def test_a_migrated_stream_resumes_its_grammar_after_the_tokens_already_sent(llm) -> None:
    """The router moves a stream to another decode node with the tokens sent so far at the end of the
    prompt and in `generated_token_ids`: the new node's grammar starts after them."""
    engine = llm.engine
    sent = engine.tokenizer.encode("12", add_special_tokens=False)
    spec = GrammarSpec("regex", "[0-9]{4}", tuple(sent))
    out = llm.generate([[5, 6, *sent]], SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured_outputs=spec))
    assert re.fullmatch("[0-9]{2}", out[0].outputs[0].text), out[0].outputs[0].text  # 2 more digits, then stop
    assert out[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="generated so far break"):
        engine.add_request("broken", [5, 6], SamplingParams(structured_outputs=("regex", "[a-z]+", tuple(sent))))
    assert engine.grammars.compile(spec) is engine.grammars.compile(GrammarSpec("regex", "[0-9]{4}"))  # one key


def test_a_mixed_batch_masks_each_row_as_it_would_alone(tiny_model_dir) -> None:
    """Grammars in different states, a terminated one and a row without one, masked in one batch
    (through the mask op once the ops are built), each row exactly as when masked alone."""
    import torch

    from pdserve.engine.grammar_cache import apply_grammar_masks
    from pdserve.engine.kernels.cpu_build import load_paged_attention_op

    assert load_paged_attention_op() is not None, "this machine has a C++ compiler: the mask op must build"
    tok = Tokenizer(tiny_model_dir)
    cache = GrammarCache(tok, tok.vocab_size, tok.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prefixes = ['{"n": ', '{"n": 7, "c": ', "{", '{"n": 3, "c": "y"}']
    matchers = []
    for text in prefixes:
        m = cache.matcher(spec)
        for token in tok.encode(text, add_special_tokens=False):
            assert m.accept_token(token), text
        matchers.append(m)
    done = cache.matcher(spec)  # terminated: the object closed, then the stop token
    for token in tok.encode('{"n": 1, "c": "x"}', add_special_tokens=False):
        assert done.accept_token(token)
    assert done.accept_token(tok.eos_token_ids[0]) and done.is_terminated()
    batch = [None, done, *matchers]  # the live rows are not the first ones: their indices must be kept
    logits = torch.randn(len(batch), tok.vocab_size)
    together = logits.clone()
    apply_grammar_masks(together, batch)
    for i, m in enumerate(batch):
        alone = logits[i : i + 1].clone()
        apply_grammar_masks(alone, [m])
        assert torch.equal(together[i], alone[0]), i
    assert not torch.isinf(together[0]).any()  # no grammar
    assert torch.isinf(together[1]).sum() == tok.vocab_size - len(tok.eos_token_ids)  # only the stop tokens
    assert all(torch.isinf(together[i]).sum() > 0 for i in range(2, len(batch)))
