"""The real pipeline runtime: greedy output equals engine.LLM for 1, 2 and 4 stages, with preemption."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from tdpipe.runtime.controller import PipeRequest
from tdpipe.runtime.local import run_local_pipeline
from tdpipe.runtime.stage_worker import StageConfig, stage_layer_range

PROMPTS = ["The old lighthouse keeper", "Once upon a time", "In the beginning the", "A quick brown fox",
           "Water is", "The capital of", "She opened the door and", "Numbers: one two three"]


def test_layer_ranges_cover_the_model_contiguously() -> None:
    for layers, stages in [(4, 1), (4, 3), (5, 2), (32, 4)]:
        ranges = [stage_layer_range(layers, stages, k) for k in range(stages)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError):
        stage_layer_range(2, 3, 0)


@pytest.mark.parametrize("num_stages,num_blocks",
                         [(1, 256), (2, 256), (2, 12), pytest.param(4, 256, marks=pytest.mark.slow)])
def test_pipeline_greedy_equals_llm(tiny_model_dir, num_stages, num_blocks) -> None:
    if num_stages > ModelConfig.from_dir(tiny_model_dir).num_hidden_layers:
        pytest.skip("tiny model has fewer layers than stages")
    max_tokens = 24
    llm = LLM(tiny_model_dir)
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    reqs = [PipeRequest(f"r{i}", p, max_tokens) for i, p in enumerate(ids)]
    finished: list[str] = []
    stats, timelines = run_local_pipeline(StageConfig(str(tiny_model_dir), num_kv_blocks=num_blocks, block_size=4),
                                          num_stages, reqs, on_finish=lambda r: finished.append(r.request_id))
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    for r, out in zip(reqs, expected):
        assert r.output_ids == out.outputs[0].token_ids, r.request_id
    assert len(timelines) == num_stages and all(timelines)
    if num_blocks < 50:
        assert stats.preemptions > 0
