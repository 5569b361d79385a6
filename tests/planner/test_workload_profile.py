"""Workloads (planner/workload.py) and profiles (planner/profile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.planner.profile import Profile, amdahl, load_profile
from pdserve.planner.workload import Lengths, Workload, from_lengths, from_trace, read_trace
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.overheads import PipelineOverheads


def write_trace(path: Path, stamps: list[float]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": 10 + i, "output_length": 3}) + "\n"
            for i, t in enumerate(stamps)
        )
    )
    return path


def test_a_trace_with_a_timestamp_running_backwards_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [0, 5, 4, 9])
    with pytest.raises(ValueError, match="line 3: timestamp 4 is before the previous line's 5"):
        read_trace(path)


def test_a_trace_keeps_its_lengths_and_its_bursts_scaled_to_the_rate(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [0, 0, 3000, 4000, 4000])  # ms
    work = from_trace(path, 4, "trace", seed=0)
    assert work.requests == (Lengths(10, 3), Lengths(11, 3), Lengths(12, 3), Lengths(13, 3))
    # 3 gaps over 4 s: 0.75 request/s natively, so 1 request/s compresses it by 0.75, 2 by 0.375
    assert work.arrivals(1.0) == pytest.approx([0, 0, 2.25, 3.0])
    assert work.arrivals(2.0) == pytest.approx([0, 0, 1.125, 1.5])
    poisson = from_trace(path, 5, "poisson", seed=0)
    assert len(poisson.requests) == 5 and list(poisson.unit_times) == sorted(poisson.unit_times)


def test_length_distributions_keep_their_mean_and_spread() -> None:
    work = from_lengths(800, 48, 0.5, 2000, seed=0)
    assert work.mean_input == pytest.approx(800, rel=0.03) and work.mean_output == pytest.approx(48, rel=0.03)
    assert min(r.input_len for r in work.requests) >= 400 and max(r.input_len for r in work.requests) <= 1200
    assert work.unit_times[-1] == pytest.approx(2000, rel=0.1)  # Poisson at 1 request/s
    with pytest.raises(ValueError):
        from_lengths(0, 10, 0.5, 10, seed=0)


def test_a_workload_repeats_itself_to_a_length() -> None:
    """Its requests repeat; Poisson arrivals go on as one Poisson process (the first ones kept), a
    trace's timestamps repeat."""
    work = from_lengths(100, 10, 0.3, 3, seed=0)
    longer = work.at_least(7)
    assert len(longer.requests) == 7 and list(longer.unit_times) == sorted(longer.unit_times)
    assert longer.requests[3:6] == work.requests and work.at_least(2) == work
    assert longer.unit_times[:3] == work.unit_times
    gaps = [b - a for a, b in zip(longer.unit_times, longer.unit_times[1:])]
    assert gaps[3:5] != gaps[0:2]  # fresh draws, not the first gaps again
    many = from_lengths(100, 10, 0.0, 5, seed=0).at_least(5000)
    assert 0.9 < len(many.unit_times) / many.unit_times[-1] < 1.1  # still rate 1
    trace = Workload(work.requests, (0.0, 1.0, 3.0))  # a trace's own times (no Poisson seed)
    assert trace.at_least(6).unit_times == (0.0, 1.0, 3.0, 4.0, 5.0, 7.0)


def test_a_td_pipe_table_names_its_hardware_and_model() -> None:
    profile = load_profile("L20-Llama-13B") if _has_l20() else None
    if profile is None:
        pytest.skip("the shared L20 tables are absent")
    assert (profile.hardware, profile.model, profile.unit, list(profile.tables)) == ("L20", "Llama-13B", "gpu", [1])
    profile.check_model("meta-llama/Llama-13B")  # a Hub id's name matches, in any case
    with pytest.raises(ValueError, match="for 'Llama-13B'"):
        profile.check_model("Qwen2.5-32B")


def test_a_degree_without_a_table_is_modelled_from_the_one_below(tmp_path: Path) -> None:
    one = CostTable("t", (1, 100), (10.0, 20.0))
    slope = PipelineOverheads(decode_context=300, decode_kv_ms=(0.002,))
    profile = Profile("m", "cpu", "core", {1: one, 2: CostTable("t2", (1, 100), (6.0, 11.0), slope)})
    four = profile.table(4, 0.8)
    ratio = amdahl(4, 0.8) / amdahl(2, 0.8)
    assert four.times_ms == pytest.approx((6.0 * ratio, 11.0 * ratio)) and "modelled" in four.name
    assert four.overheads.decode_kv_ms == pytest.approx((0.002 * ratio,)) and four.overheads.decode_context == 300
    assert profile.table(2, 0.8).times_ms == (6.0, 11.0) and profile.is_profiled(2) and not profile.is_profiled(4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    back = load_profile(str(path))
    assert (back.model, back.unit, back.tables[2].times_ms) == ("m", "core", (6.0, 11.0))
    assert back.tables[2].overheads == slope and back.tables[1].overheads == PipelineOverheads()


def _has_l20() -> bool:
    try:
        CostTable.builtin("L20-Llama-13B")
    except ValueError:
        return False
    return True
