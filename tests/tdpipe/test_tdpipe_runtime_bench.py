"""The runtime benchmark's pieces: stage profiling -> CostTable, timeline bubble maths, and (slow) --quick.

Never asserts speed: timings on the shared CI machines mean nothing; only shape and semantics.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.tdpipe.runtime.profile import (
    StageProfile,
    build_cost_table,
    mean_decode_context,
    monotone,
    plan_profile,
    profile_stages,
)
from pdserve.tdpipe.runtime.timeline import bubble_fraction, bubble_fractions, job_span, phase_switches, plot_timelines

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("together", [True, False])
def test_profile_tiny_model_gives_a_well_formed_table(tiny_model_dir, together) -> None:
    """Side by side (a process per stage, the CPU default) or one stage at a time in this process."""
    profiles = profile_stages(
        tiny_model_dir,
        2,
        decode_batches=[1, 2, 4],
        prefill_tokens=[4, 16, 32],
        decode_context=20,
        prefill_prompt_len=8,
        block_size=4,
        repeats=1,
        attention_backend="torch",
        together=together,
    )
    assert [p.prefill_prompt_len for p in profiles] == [8, 8] and [p.stage for p in profiles] == [0, 1]
    # the stages' own split (`model_stage_ranges`: tiny's head costs under half a layer)
    assert [p.layer_range for p in profiles] == [(0, 2), (2, 4)]
    for p in profiles:
        assert sorted(p.decode_ms) == [1, 2, 4] and sorted(p.prefill_ms) == [4, 16, 32]
        assert all(t > 0 for t in [*p.decode_ms.values(), *p.prefill_ms.values()])
        assert p.decode_kv_ms >= 0.0  # the largest batch timed again at 40 KV tokens (clamped: noise)
    table = build_cost_table(profiles, "tiny")
    if any(p.decode_kv_ms for p in profiles):
        assert table.overheads.decode_context == 20
    # decode rows up to the largest decode batch, prefill rows strictly above it
    assert table.tokens == (1, 2, 4, 16, 32)
    assert all(a <= b for a, b in zip(table.times_ms, table.times_ms[1:]))
    # stage_ms is the bottleneck stage's measured time, fitted monotone
    bottleneck = [max(p.decode_ms[n] for p in profiles) for n in (1, 2, 4)]
    bottleneck += [max(p.prefill_ms[n] for p in profiles) for n in (16, 32)]
    assert [table.stage_ms(n, 2) for n in table.tokens] == pytest.approx(monotone(bottleneck))


def test_monotone_fit_averages_a_point_that_breaks_the_order() -> None:
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # a slow 32 (122) before a faster 41 (96): both 109, not both 122 as a running max gave
    assert monotone([57.0, 122.0, 96.0]) == pytest.approx([57.0, 109.0, 109.0])
    assert monotone([5.0, 1.0, 1.0, 9.0]) == pytest.approx([7 / 3, 7 / 3, 7 / 3, 9.0])
    assert monotone([]) == []


def test_a_stage_that_cannot_be_profiled_says_which_and_why(tiny_model_dir) -> None:
    with pytest.raises(RuntimeError, match=r"profiling stage \d: ValueError: .*nope"):
        profile_stages(
            tiny_model_dir, 2, decode_batches=[1], prefill_tokens=[8], decode_context=8, attention_backend="nope"
        )


def test_profile_plan_follows_the_job() -> None:
    # request 1: prompt 10, 3 outputs -> decode tokens 2 and 3 run over 11 and 12 tokens of KV
    assert mean_decode_context([10], [3]) == round((11 + 12) / 2)
    prompts, outputs = [100] * 8, [20] * 8
    plan = plan_profile(prompts, outputs, kv_tokens=480, num_stages=2, max_batch_tokens=512)
    # 480 tokens hold 4 of the 120-token requests; 1.5 x 4 / 2 stages = 3
    assert plan.decode_max == 3 and plan.decode_batches == [1, 2, 3]
    assert plan.prefill_tokens == [64 * k for k in range(1, 9)] and plan.prefill_prompt_len == 100
    quick = plan_profile(prompts, outputs, kv_tokens=480, num_stages=2, max_batch_tokens=512, quick=True)
    assert quick.prefill_tokens == [256, 512]
    # a job whose prompts total 20 tokens never forms a bigger prefill batch: no time spent above it
    assert max(plan_profile([10, 10], [5, 5], kv_tokens=1000, num_stages=2, max_batch_tokens=512).prefill_tokens) == 20
    # prompts of 100 and 300 tokens: the average prompt token sits in a (100^2 + 300^2) / 400 = 250-token prompt
    assert (
        plan_profile([100, 300], [5, 5], kv_tokens=1000, num_stages=2, max_batch_tokens=512).prefill_prompt_len == 250
    )
    with pytest.raises(ValueError):
        plan_profile([], [], kv_tokens=1, num_stages=1, max_batch_tokens=1)


def test_table_semantics_from_synthetic_profiles() -> None:
    a = StageProfile(0, (0, 2), 100, decode_ms={1: 10.0, 8: 20.0}, prefill_ms={4: 1.0, 64: 50.0})
    b = StageProfile(1, (2, 4), 100, decode_ms={1: 12.0, 8: 18.0}, prefill_ms={4: 2.0, 64: 40.0})
    table = build_cost_table([a, b])
    assert table.tokens == (1, 8, 64)  # the prefill point at 4 <= the largest decode batch is left out
    assert table.stage_ms(1, 2) == pytest.approx(12.0)
    assert table.stage_ms(8, 2) == pytest.approx(20.0)
    assert table.stage_ms(64, 2) == pytest.approx(50.0)
    # a cut at the largest decode batch the policies form: decode interpolated there, prefill above
    cut = build_cost_table([a, b], decode_max=4)
    assert cut.tokens == (1, 4, 64)
    assert cut.stage_ms(4, 2) == pytest.approx(12.0 + (20.0 - 12.0) * 3 / 7)
    assert cut.stage_ms(64, 2) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        build_cost_table([a, StageProfile(1, (2, 4), 100, decode_ms={1: 1.0}, prefill_ms={64: 1.0})])


def test_bubble_and_switches_from_timelines(tmp_path) -> None:
    # stage 0 busy 0-2 and 3-4 (3 of 4 s); stage 1 busy 1-3 (2 of 4 s)
    timelines = [[(10.0, 12.0, 64, "prefill"), (13.0, 14.0, 2, "decode")], [(11.0, 13.0, 64, "prefill")]]
    assert job_span(timelines) == (10.0, 14.0)
    assert bubble_fractions(timelines) == pytest.approx([0.25, 0.5])
    assert bubble_fraction(timelines) == pytest.approx(0.375)
    assert phase_switches(timelines[0]) == 1 and phase_switches(timelines[1]) == 0
    pytest.importorskip("matplotlib")
    plot_timelines({"run": timelines}, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_benchmark_prints_json(tmp_path) -> None:
    png = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.tdpipe_runtime", "--quick", "--rounds", "2", "--plot", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("metric", "value", "baseline", "ratio", "target", "sim_error", "bubble", "tok_s", "bubble_error_pp"):
        assert key in result
    # the simulated bubble's error in percentage points, and how long the (cacheable) profile took
    for policy, err in result["bubble_error_pp"].items():
        assert err == pytest.approx(100 * (result["sim_bubble"][policy] - result["bubble"][policy]), abs=0.2)
    assert result["profile_seconds"] >= 0 and isinstance(result["profile_cached"], bool)
    assert set(result["overheads"]) >= {"handoff_ms", "dispatch_ms"}
    assert result["target"] == 1.3 and "tdpipe" in result["tok_s"] and "tdpipe" in result["sim_error"]
    # every arm ran once per round; value and baseline are the two policies' median rates, the ratio
    # the median of the rounds' paired ratios
    rounds = result["per_round"]
    assert result["rounds"] == len(rounds) == 2 and all(set(r) == {"llm", "tdpipe", "pp-sb", "pp-hb"} for r in rounds)
    assert result["value"] == pytest.approx(statistics.median(r["tdpipe"] for r in rounds), abs=0.1)
    assert result["baseline"] == pytest.approx(statistics.median(r["pp-sb"] for r in rounds), abs=0.1)
    paired = [r["tdpipe"] / r["pp-sb"] for r in rounds]
    assert result["ratio_per_round"] == pytest.approx(paired, abs=2e-3)
    assert result["ratio"] == pytest.approx(statistics.median(paired), abs=2e-3)
    assert len(result["llm_ratio_per_round"]) == 2
    assert png.is_file()


def test_the_benchmark_plans_on_predicted_lengths_unless_told_exact() -> None:
    from benchmarks.tdpipe_runs import build_workload, sim_requests

    reqs = build_workload(64, 128, 256, vocab=500)
    exact = build_workload(64, 128, 256, vocab=500, exact_lengths=True)
    # the same job (prompts, true lengths); only what the policies plan on differs
    assert [(r.prompt_ids, r.output_len) for r in reqs] == [(r.prompt_ids, r.output_len) for r in exact]
    assert all(r.predicted_len == r.output_len for r in exact)
    assert sum(r.predicted_len != r.output_len for r in reqs) > len(reqs) // 2  # bucket means, 55% right bucket
    sims = sim_requests(reqs)
    assert [(s.output_len, s.predicted_len) for s in sims] == [(r.output_len, r.predicted_len) for r in reqs]
