"""The real pipeline runtime: every policy's greedy output equals engine.LLM for 1, 2 and 4 stages,
with and without preemption, and a policy decides the same on real stages as in the simulator."""

from __future__ import annotations

import copy

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_config import ModelConfig
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import SimExecutor
from pdserve.tdpipe.runtime.controller import PipeRequest
from pdserve.tdpipe.runtime.local import run_local_pipeline
from pdserve.tdpipe.runtime.stage_worker import StageConfig, stage_layer_range
from pdserve.tdpipe.simulator import make_policy
from pdserve.tdpipe.workload import SimRequest
from tests.tdpipe.batch_helpers import PROMPTS as BATCH_PROMPTS

PROMPTS = [*BATCH_PROMPTS, "She opened the door and", "Numbers: one two three"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy output ids of pdserve.engine.LLM) for PROMPTS."""
    llm = LLM(tiny_model_dir)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [llm.tokenizer.encode(p) for p in PROMPTS], [o.outputs[0].token_ids for o in outs]


def test_layer_ranges_cover_the_model_contiguously() -> None:
    for layers, stages in [(4, 1), (4, 3), (5, 2), (32, 4)]:
        ranges = [stage_layer_range(layers, stages, k) for k in range(stages)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError):
        stage_layer_range(2, 3, 0)


def _run(tiny_model_dir, expected, num_stages: int, num_blocks: int, policy: str, max_batch_tokens: int = 2048):
    if num_stages > ModelConfig.from_dir(tiny_model_dir).num_hidden_layers:
        pytest.skip("tiny model has fewer layers than stages")
    prompts, outputs = expected
    reqs = [PipeRequest(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    finished: list[str] = []
    decisions: list = []
    stats, timelines = run_local_pipeline(
        StageConfig(str(tiny_model_dir), num_kv_blocks=num_blocks, block_size=4),
        num_stages,
        reqs,
        max_batch_tokens,
        on_finish=lambda r: finished.append(r.request_id),
        policy=policy,
        decisions=decisions,
    )
    assert sorted(finished) == sorted(r.request_id for r in reqs)  # each reported exactly once
    for r, out in zip(reqs, outputs):
        assert r.output_ids == out, (policy, r.request_id)
        assert not r.block_ids
    assert stats.output_tokens == MAX_TOKENS * len(reqs)  # a recomputed prefill yields the next token, not a repeat
    assert len(timelines) == num_stages and all(timelines)
    return stats, decisions


@pytest.mark.parametrize("num_stages,num_blocks", [(1, 256), pytest.param(4, 256, marks=pytest.mark.slow)])
def test_tdpipe_greedy_equals_llm(tiny_model_dir, expected, num_stages, num_blocks) -> None:
    stats, _ = _run(tiny_model_dir, expected, num_stages, num_blocks, "tdpipe")
    assert [p for _, p in stats.phase_switches[:2]] == ["prefill", "decode"]


@pytest.mark.parametrize("num_stages", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["tdpipe", "pp-sb", "pp-hb"])
def test_every_policy_equals_llm_and_decides_as_in_the_simulator(tiny_model_dir, expected, policy, num_stages) -> None:
    """Greedy output equals engine.LLM under preemption, and the recorded decision log (every
    batch: phase, requests, new tokens, sampling) on real stages equals the log of the same policy
    driven by the simulator on requests of the same lengths."""
    # 9 blocks of 4 tokens per stage cannot hold 8 prompts of ~5 tokens plus 24 outputs each, so requests
    # are recompute-preempted (one request still fits a PP virtual engine's share of the pool);
    # an 8-token budget makes PP+HB chunk its prompts.
    blocks, budget = 9 * num_stages, 8
    runtime_stats, runtime_log = _run(tiny_model_dir, expected, num_stages, blocks, policy, max_batch_tokens=budget)
    assert runtime_stats.num_preemptions > 0, policy
    if policy == "pp-hb":
        assert any(n > 1 and not sample for _, items in runtime_log for _, n, sample in items)  # a non-final chunk
    prompts, _ = expected
    sim_reqs = [SimRequest(f"r{i}", len(p), MAX_TOKENS, MAX_TOKENS) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    inst = InstanceConfig(num_stages=num_stages, capacity_blocks=blocks, block_size=4, max_batch_tokens=budget)
    sim = SimExecutor(CostTable.analytic(), num_stages)
    sim_stats = make_policy(policy, CostTable.analytic(), inst).run(copy.deepcopy(sim_reqs), sim)
    assert sim.decisions == runtime_log
    assert sim_stats.num_preemptions == runtime_stats.num_preemptions
    assert len(sim_stats.phase_switches) == len(runtime_stats.phase_switches)


def test_sampled_requests_equal_llm_with_the_same_seed(tiny_model_dir) -> None:
    """The last stage samples with each request's own parameters and seeded generator, so a
    seeded, penalised, top-p request equals engine.LLM's, even through recompute preemption."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7, ignore_eos=True
    )
    llm = LLM(tiny_model_dir)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    reqs = [PipeRequest(f"r{i}", llm.tokenizer.encode(p), MAX_TOKENS, params=params) for i, p in enumerate(PROMPTS)]
    stats, _ = run_local_pipeline(
        StageConfig(str(tiny_model_dir), num_kv_blocks=18, block_size=4), 2, reqs, max_batch_tokens=8, policy="tdpipe"
    )
    assert stats.num_preemptions > 0
    assert [r.output_ids for r in reqs] == expected
    assert any(
        out != greedy
        for out, greedy in zip(
            expected,
            [
                o.outputs[0].token_ids
                for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            ],
        )
    )  # really sampled
