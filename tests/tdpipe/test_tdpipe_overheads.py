"""Fitted pipeline overheads (tdpipe/overheads.py): the fit, the simulator's timing with them, and
the profile pass's measurement of them (tdpipe/runtime/profile_comm.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.overheads import LinearCost, PipelineOverheads
from pdserve.tdpipe.pipeline import Pipeline, SimStats
from pdserve.tdpipe.runtime.profile import StageProfile, build_cost_table
from pdserve.tdpipe.runtime.profile_comm import measure_overheads, pipeline_overheads

FLAT = CostTable("flat", (1, 4096), (20.0, 20.0))  # 10 ms per stage on 2 stages, any size


def test_linear_fit_recovers_a_line_and_never_goes_negative() -> None:
    line = LinearCost.fit({1: 2.5, 101: 7.5, 201: 12.5})
    assert line.base_ms == pytest.approx(2.45) and line.per_token_ms == pytest.approx(0.05)
    assert line(1000) == pytest.approx(52.45)
    flat = LinearCost.fit({1: 4.0, 64: 2.0})  # a falling noisy pair: a constant at the mean
    assert flat == LinearCost(3.0, 0.0)
    origin = LinearCost.fit({10: 1.0, 20: 3.0})  # the line would cross zero: through the origin
    assert origin.base_ms == 0.0 and origin.per_token_ms > 0
    with pytest.raises(ValueError):
        LinearCost(-1.0, 0.0)
    with pytest.raises(ValueError):
        LinearCost.fit({})


def test_overheads_round_trip_and_validate() -> None:
    over = PipelineOverheads(LinearCost(1.0, 0.01), LinearCost(3.0, 0.002), (0.5, 1.0), (1.0, 0.9))
    assert PipelineOverheads.from_dict(over.to_dict()) == over
    assert over.shares(2, decode=True) == (0.5, 1.0) and over.shares(3, decode=True) == (1.0, 1.0, 1.0)
    assert PipelineOverheads().is_zero and not over.is_zero
    with pytest.raises(ValueError):
        PipelineOverheads(decode_shares=(0.0, 1.0))
    kv = PipelineOverheads(decode_context=300, decode_kv_ms=(0.002, 0.001))
    assert PipelineOverheads.from_dict(kv.to_dict()) == kv
    # 4 sequences of 500 KV tokens: 800 tokens beyond 4 x 300; each stage pays its own slope
    assert kv.decode_kv_extra(2, 4, 2000) == pytest.approx((1.6, 0.8))
    assert kv.decode_kv_extra(2, 4, 800) == pytest.approx((-0.8, -0.4))  # shorter KV: cheaper
    assert kv.decode_kv_extra(3, 4, 2000) == (0.0, 0.0, 0.0)  # profiled for another pipeline
    with pytest.raises(ValueError):
        PipelineOverheads(decode_context=300, decode_kv_ms=(-0.1, 0.0))


def test_pipeline_charges_dispatch_handoff_and_unequal_stages() -> None:
    stats = SimStats("t")
    ideal = Pipeline(FLAT, 2, stats)
    assert ideal.submit(8, 0.0) == pytest.approx(20.0)
    over = PipelineOverheads(LinearCost(1.0, 0.0), LinearCost(2.0, 0.5), (0.5, 1.0), ())
    stats = SimStats("t")
    pipe = Pipeline(CostTable("flat", (1, 4096), (20.0, 20.0), over), 2, stats)
    # dispatch 2 + 0.5*8 = 6, stage 0 runs 5 (half the slowest), hand-off 1, stage 1 runs 10
    assert pipe.submit(8, 0.0, decode=True) == pytest.approx(22.0)
    assert stats.busy_ms == pytest.approx(15.0)
    assert stats.bubble_ms == pytest.approx(2 * 22.0 - 15.0)
    # a prefill batch (no prefill shares: equal stages) queues behind the first on stage 0 (free at
    # 11), runs 10 there, is handed off (1) and runs 10 on stage 1
    assert pipe.submit(8, 0.0, decode=False) == pytest.approx(11.0 + 10.0 + 1.0 + 10.0)


def test_a_decode_step_costs_what_its_kv_reads_add_to_the_table() -> None:
    """The table prices a decode step at one KV length (the profile's); each stage's KV slope adds
    what longer sequences read (a phase's last steps) and takes off what shorter ones do not."""
    over = PipelineOverheads(decode_context=100, decode_kv_ms=(0.01, 0.005))
    table = CostTable("flat", (1, 4096), (20.0, 20.0), over)  # 10 ms a stage
    runs = {}
    for kv in (None, 800, 4 * 100, 4 * 200):
        stats = SimStats("t")
        runs[kv] = (Pipeline(table, 2, stats).submit(4, 0.0, decode=True, kv_tokens=kv), stats.busy_ms)
    assert runs[None] == runs[400] == (pytest.approx(20.0), pytest.approx(20.0))  # at the table's length
    # 400 tokens more: stage 0 takes 10 + 4, stage 1 10 + 2
    assert runs[800] == (pytest.approx(26.0), pytest.approx(26.0))
    stats = SimStats("t")  # a prefill batch is priced by the table alone
    assert Pipeline(table, 2, stats).submit(4, 0.0, decode=False, kv_tokens=10_000) == pytest.approx(20.0)
    # the slope never makes a stage's time negative
    stats = SimStats("t")
    steep = CostTable("flat", (1, 4096), (20.0, 20.0), PipelineOverheads(decode_context=100, decode_kv_ms=(1.0, 1.0)))
    assert Pipeline(steep, 2, stats).submit(4, 0.0, decode=True, kv_tokens=4) == pytest.approx(0.0)


def _profile(stage: int, decode: dict[int, float], prefill: dict[int, float]) -> StageProfile:
    return StageProfile(stage, (stage, stage + 1), 100, decode, prefill)


def test_profiled_table_carries_the_fitted_overheads() -> None:
    first = _profile(0, {1: 5.0, 8: 10.0}, {512: 40.0, 2048: 160.0})
    last = _profile(1, {1: 10.0, 8: 20.0}, {512: 40.0, 2048: 160.0})
    first.handoff_ms = {1: 1.0, 2048: 3.0}
    first.dispatch_ms = {1: 2.0, 8: 2.0}
    table = build_cost_table([first, last], "p", decode_max=8)
    over = table.overheads
    assert over.decode_shares == pytest.approx((0.5, 1.0)) and over.prefill_shares == pytest.approx((1.0, 1.0))
    assert over.handoff(2048) == pytest.approx(3.0) and over.dispatch(8) == pytest.approx(2.0)
    one = pipeline_overheads([first.decode_ms], [first.prefill_ms], first.handoff_ms, first.dispatch_ms, 8)
    assert one.handoff == LinearCost()  # one stage hands nothing off
    assert over.decode_kv_ms == () and over.decode_context == 0  # no slope measured: none charged
    first.decode_kv_ms, last.decode_kv_ms = 0.002, 0.001
    sloped = build_cost_table([first, last], "p", decode_max=8).overheads
    assert sloped.decode_kv_ms == (0.002, 0.001) and sloped.decode_context == 100


def test_measure_overheads_replays_the_messages_quickly() -> None:
    handoff, dispatch = measure_overheads(
        64, torch.float32, [1, 256], [1, 8], decode_context=64, repeats=2, prefill_tokens=256, prompt_len=64
    )
    assert set(handoff) == {1, 256} and set(dispatch) == {1, 8, 256}
    assert all(0 < t < 5_000 for t in [*handoff.values(), *dispatch.values()])


def test_the_measured_overheads_are_cached_with_the_profile(tmp_path) -> None:
    from pdserve.tdpipe.runtime import profile_cache as pc

    first = _profile(0, {1: 5.0}, {512: 40.0})
    first.handoff_ms, first.dispatch_ms = {1: 1.0, 512: 2.0}, {1: 3.0}
    first.decode_kv_ms = 0.0015
    key = {"version": pc.CACHE_VERSION, "model": "m"}
    pc.save(tmp_path / "p.json", key, [first, _profile(1, {1: 6.0}, {512: 41.0})])
    loaded = pc.load(tmp_path / "p.json", key)
    assert loaded is not None and loaded[0].handoff_ms == {1: 1.0, 512: 2.0} and loaded[0].dispatch_ms == {1: 3.0}
    assert loaded[0].decode_kv_ms == 0.0015 and loaded[1].decode_kv_ms == 0.0
    assert pc.CACHE_VERSION >= 2  # profiles cached before the overheads were measured are not reused
