"""benchmarks/planner_shift.py's pure half: the shifting schedule and how a run is scored."""

from __future__ import annotations

import pytest

from benchmarks.planner_shift import DECODE_HEAVY, PREFILL_HEAVY, decisions_in, kind_of, schedule, score


def test_the_schedule_shifts_from_prefill_heavy_to_decode_heavy_and_back():
    records = schedule(100.0, 0.5, 1.0, seed=1)
    times = [r["timestamp"] / 1e3 for r in records]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 300
    phases = [[r for r, t in zip(records, times) if k * 100 <= t < (k + 1) * 100] for k in range(3)]
    assert {r["input_length"] for r in phases[0] + phases[2]} == {PREFILL_HEAVY.input_tokens}
    assert {r["output_length"] for r in phases[1]} == {DECODE_HEAVY.output_tokens}
    # Poisson at the phase's rate: about 50, 100, 50 requests (far outside these bounds is a bug)
    assert 25 < len(phases[0]) < 80 and 65 < len(phases[1]) < 140 and 25 < len(phases[2]) < 80
    ids = [h for r in records for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))  # no prompt shares a prefix with another
    assert schedule(100.0, 0.5, 1.0, seed=1) == records and schedule(100.0, 0.5, 1.0, seed=2) != records


@pytest.mark.parametrize("bad", [(0, 1, 1), (10, 0, 1), (10, 1, -1)])
def test_bad_schedule_flags_are_refused(bad):
    with pytest.raises(ValueError, match="--phase-s, --prefill-rate and --decode-rate"):
        schedule(*bad, seed=0)


def record(isl: int | None, ttft_ms: float, latency_ms: float, osl: int, error: bool = False) -> dict:
    metrics = {
        "time_to_first_token": {"value": ttft_ms},
        "request_latency": {"value": latency_ms},
        "output_sequence_length": {"value": osl},
    }
    if isl is not None:
        metrics["input_sequence_length"] = {"value": isl}
    return {"metrics": {} if error else metrics, **({"error": {"message": "x"}} if error else {})}


def test_a_run_is_scored_by_requests_within_both_slos_per_second():
    records = [
        record(1024, 1000, 1000 + 15 * 100, 16),  # met
        record(1024, 6000, 6000 + 15 * 100, 16),  # TTFT over 5 s
        record(64, 200, 200 + 191 * 300, 192),  # TPOT 0.3 s: over 0.25
        record(64, 200, 200 + 191 * 100, 192),  # met
        record(None, 0, 0, 0, error=True),  # failed, its kind unknown
    ]
    assert [kind_of(r) for r in records[:4]] == ["prefill_heavy"] * 2 + ["decode_heavy"] * 2
    got = score(records, {"prefill_heavy": 3, "decode_heavy": 2}, span_s=10.0)
    assert got["goodput_req_s"] == 0.2 and got["attainment"] == 0.4
    assert got["by_kind"]["prefill_heavy"] == {"sent": 3, "met": 1, "failed": 0}
    assert got["by_kind"]["unknown"]["failed"] == 1


def test_planner_decisions_are_read_from_the_routers_metrics():
    text = "\n".join(
        [
            "# HELP pdserve_planner_decisions_total decisions",
            'pdserve_planner_decisions_total{action="hold"} 12.0',
            'pdserve_planner_decisions_total{action="move_to_decode"} 1.0',
            'pdserve_planner_desired_replicas{role="decode"} 2.0',
        ]
    )
    assert decisions_in(text) == {"hold": 12.0, "move_to_decode": 1.0}
