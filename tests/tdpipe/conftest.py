"""Fixtures of the tdpipe tests."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.tdpipe.batch_helpers import MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def batch_expected(tiny_model_dir) -> dict[str, str]:
    """engine.LLM's greedy text for each of the batch tests' PROMPTS, by custom_id `r<i>`."""
    outs = LLM(tiny_model_dir).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    return {f"r{i}": o.outputs[0].text for i, o in enumerate(outs)}
