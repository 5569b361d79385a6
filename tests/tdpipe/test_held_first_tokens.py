"""A prefill phase's first tokens sampled together (`StageMessage.hold`): the last stage keeps a held
batch's final hidden states and samples them with the next batch that is not held, in passes of the
LM head of up to `HEAD_ROWS` rows; the controller reads their tokens from that batch's answer."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Batch, BatchItem, SimExecutor
from pdserve.tdpipe.runtime.controller import PipeRequest, StageExecutor
from pdserve.tdpipe.runtime import last_stage
from pdserve.tdpipe.runtime.last_stage import NO_TOKEN, STOP_ROW, TOKEN_ROW, HeldRows, LastStageSampler, StageMessage
from pdserve.tdpipe.runtime.local import run_local_pipeline
from pdserve.tdpipe.runtime.stage_worker import StageConfig
from pdserve.tdpipe.simulator import make_policy
from pdserve.tdpipe.workload import SimRequest
from tests.tdpipe.batch_helpers import stop_string_in

VOCAB, HIDDEN = 11, 4


def _message(rids: list[str], sample: list[bool], hold: bool, new_params=None) -> StageMessage:
    batch = ForwardBatch(
        request_ids=rids,
        input_ids=[1] * len(rids),
        query_lens=[1] * len(rids),
        context_lens=[1] * len(rids),
        block_tables=[[0]] * len(rids),
        sample_mask=sample,
    )
    return StageMessage(batch, new_params or {}, hold=hold)


class _Head:
    """A stand-in LM head that records how many passes it made."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.weight = torch.randn(VOCAB, HIDDEN)
        self.passes: list[int] = []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.passes.append(rows.shape[0])
        return rows @ self.weight.T


def test_held_rows_are_sampled_with_the_next_batch_in_one_head_pass() -> None:
    head, held, sampler = _Head(), HeldRows(), LastStageSampler()
    rows = {rid: torch.randn(1, HIDDEN) for rid in "abcde"}
    expected = {rid: int(head(r).argmax()) for rid, r in rows.items()}
    head.passes.clear()
    # batch 1 (held): a and a non-final chunk of b; batch 2 (held): b's last chunk; batch 3: c, d, e (d not sampled)
    assert held.step(_message(["a", "b"], [True, False], True), rows["a"], head, sampler) is None
    assert held.step(_message(["b"], [True], True), rows["b"], head, sampler) is None
    last = torch.cat([rows["c"], rows["e"]])
    out = held.step(_message(["c", "d", "e"], [True, False, True], False), last, head, sampler)
    assert out is not None and head.passes == [4]  # a, b, c, e: one pass
    assert out.shape == (2, 2 + 3)  # the two held sampled rows first, then this batch's three sequences
    assert out[TOKEN_ROW].tolist() == [expected["a"], expected["b"], expected["c"], NO_TOKEN, expected["e"]]
    assert out[STOP_ROW].tolist() == [0] * 5
    # nothing is kept once answered: the next batch answers for itself alone
    out = held.step(_message(["a"], [True], False), rows["a"], head, sampler)
    assert out is not None and out[TOKEN_ROW].tolist() == [expected["a"]] and head.passes == [4, 1]
    assert held.request_ids == [] and held.hidden == []


def test_many_held_rows_are_sampled_in_bounded_head_passes(monkeypatch) -> None:
    """A phase of many prompts: the head takes at most HEAD_ROWS rows a pass, same tokens."""
    monkeypatch.setattr(last_stage, "HEAD_ROWS", 2)
    head, held, sampler = _Head(), HeldRows(), LastStageSampler()
    rows = torch.randn(5, HIDDEN)
    expected = head(rows).argmax(dim=-1).tolist()
    head.passes.clear()
    for i in range(4):
        assert held.step(_message([f"r{i}"], [True], True), rows[i : i + 1], head, sampler) is None
    out = held.step(_message(["r4"], [True], False), rows[4:], head, sampler)
    assert out is not None and out[TOKEN_ROW].tolist() == expected
    assert head.passes == [2, 2, 1]


def test_a_held_request_is_announced_before_it_is_sampled() -> None:
    """Parameters that come with a held batch's message apply when the rows are sampled later."""
    head, held, sampler = _Head(), HeldRows(), LastStageSampler()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    assert (
        held.step(_message(["s"], [True], True, {"s": (params, [1, 2])}), torch.randn(1, HIDDEN), head, sampler) is None
    )
    assert "s" in sampler.states and "s" in sampler.generators
    out = held.step(_message(["g"], [True], False), torch.randn(1, HIDDEN), head, sampler)
    assert out is not None and sampler.states["s"].output_token_ids == [int(out[TOKEN_ROW, 0])]


class _Recording(SimExecutor):
    def __init__(self, table: CostTable, num_stages: int) -> None:
        super().__init__(table, num_stages)
        self.holds: list[tuple[str, bool]] = []

    def _start(self, batch: Batch) -> None:
        self.holds.append((batch.phase, batch.hold))
        super()._start(batch)


@pytest.mark.parametrize("policy, holds", [("tdpipe", True), ("td-pipe-head-per-batch", False), ("pp-sb", False)])
def test_tdpipe_holds_every_prefill_batch_of_a_phase_but_its_last(policy: str, holds: bool) -> None:
    table = CostTable("cpu-like", (1, 64, 2048), (40.0, 80.0, 2048.0))
    inst = InstanceConfig(num_stages=2, capacity_blocks=400, block_size=4, max_batch_tokens=32)
    reqs = [SimRequest(f"r{i}", 20 + i, 6, 6) for i in range(8)]
    ex = _Recording(table, 2)
    make_policy(policy, table, inst).run(reqs, ex)
    assert not any(hold for phase, hold in ex.holds if phase != "prefill")
    if not holds:
        assert not any(hold for _, hold in ex.holds)
        return
    runs, current = [], []  # a phase's prefill batches end with the one that is not held
    for phase, hold in ex.holds:
        if phase == "prefill":
            current.append(hold)
            if not hold:
                runs.append(current)
                current = []
    assert current == []  # nothing is left held when the job ends
    assert len(runs) == sum(1 for _, phase in ex.stats.phase_switches if phase == "prefill")
    assert any(len(run) > 1 for run in runs)  # the premise: phases of several batches


def test_a_held_batch_collected_before_its_answer_was_submitted_is_refused() -> None:
    ex = StageExecutor(num_stages=1, num_kv_blocks=4, block_size=4)
    request = PipeRequest("r", [1, 2, 3], 2)
    ex.inflight.append(Batch([BatchItem(request, 3, True)], "prefill", 0.0, hold=True))
    with pytest.raises(RuntimeError, match="held batch was collected before"):
        ex.collect()


@pytest.mark.parametrize("hold", [True, False])
def test_held_first_tokens_with_stop_strings_and_seeds_equal_llm(tiny_model_dir, hold: bool) -> None:
    """Seeded sampling and stop strings through prefill phases of several batches, first tokens
    held (or not): the same tokens as engine.LLM, and the stop string ends each request there."""
    prompts = [
        "The cat sat on",
        "Once upon a time there",
        "Numbers: one two three",
        "She opened the door and",
        "A",
        "Rain fell on the quiet town all night",
        "x y",
        "Hello there my friend",
    ]
    llm = LLM(tiny_model_dir)
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(len(prompts))]
    for i in (1, 3):  # a stop string cut from what the request would say without one
        text = llm.generate([prompts[i]], params[i])[0].outputs[0].text
        params[i] = SamplingParams(
            max_tokens=12, temperature=0.9, seed=11 + i, ignore_eos=True, stop=[stop_string_in(text)]
        )
    expected = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    reqs = [
        PipeRequest(f"r{i}", llm.tokenizer.encode(p), 12, params=sp) for i, (p, sp) in enumerate(zip(prompts, params))
    ]
    policy = "tdpipe" if hold else "td-pipe-head-per-batch"
    cfg = StageConfig(str(tiny_model_dir), num_kv_blocks=128, block_size=4)
    decisions: list = []
    run_local_pipeline(cfg, 2, reqs, max_batch_tokens=12, policy=policy, decisions=decisions)
    assert [r.output_ids for r in reqs] == expected
    first = [items for phase, items in decisions if phase == "prefill"][:-1]  # the held ones, with hold
    assert len({sum(sample for _, _, sample in items) for items in first}) > 1  # held batches of unequal samples
    assert any(len(out) < 12 for out in expected)  # the premise: a stop string ended a request
