"""Bad requests are rejected with clear errors and the engine keeps serving."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "empty"),
        ([5] * 200, "max_model_len"),
        ([5, -1], "outside the vocabulary"),
        ([5, 10**6], "outside the vocabulary"),
    ],
)
def test_rejected_then_still_serving(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6], prompt], SamplingParams(max_tokens=4))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == 64


def test_max_tokens_that_cannot_fit(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=100))


def test_stop_tokens_and_strings(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]))
    assert out[0].outputs[0].token_ids == base.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
