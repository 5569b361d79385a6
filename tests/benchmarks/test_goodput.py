"""benchmarks/goodput.py's pure logic: SLO attainment from AIPerf records, the search on rate, shape
parsing, trace checking and scaling, the result line, and one step through a stand-in `aiperf` that
writes per-request records in AIPerf's format (no AIPerf, no vLLM, no server)."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.goodput import build_parser, make_plan, measure_step, result_line
from benchmarks.goodput_client import HUB_ID, Client, local_hub_cache, poisson_args, trace_args, write_trace
from benchmarks.goodput_load import Shape, load_trace, native_rate, parse_shapes, scale_trace
from benchmarks.host_cpu import CpuSampler
from benchmarks.goodput_slo import (
    Slo,
    attainment,
    failure_reasons,
    outcome_of,
    profiling_records,
    search_goodput,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
SLO = Slo(ttft_s=5.0, tpot_s=0.25)


def record(
    ttft_ms: float, latency_ms: float, tokens: int = 48, phase: str = "profiling", prompt: int | None = None
) -> dict:
    """A successful request as AIPerf's profile_export.jsonl writes it."""
    metrics = {
        "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
        "request_latency": {"value": latency_ms, "unit": "ms"},
        "output_sequence_length": {"value": tokens, "unit": "tokens"},
    }
    if prompt is not None:
        metrics["input_sequence_length"] = {"value": prompt, "unit": "tokens"}
    return {
        "metadata": {"benchmark_phase": phase, "was_cancelled": False},
        "metrics": metrics,
        "error": None,
    }


FAILED = {
    "metadata": {"benchmark_phase": "profiling", "was_cancelled": False},
    "metrics": {"error_isl": {"value": 800, "unit": "tokens"}},
    "error": {"code": 503, "type": "HTTPError", "message": "Service Unavailable"},
}


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    o = outcome_of(record(ttft_ms=2000.0, latency_ms=2000.0 + 47 * 100.0))
    assert o.ok and o.ttft_s == 2.0 and math.isclose(o.tpot_s, 0.1) and o.output_tokens == 48
    assert outcome_of(record(1000.0, 1000.0, tokens=1)).tpot_s == 0.0


def test_failed_cancelled_and_tokenless_requests_are_not_ok():
    assert not outcome_of(FAILED).ok
    cancelled = {**record(100.0, 200.0), "metadata": {"was_cancelled": True}}
    assert not outcome_of(cancelled).ok
    assert not outcome_of(record(100.0, 200.0, tokens=0)).ok


def test_attainment_counts_both_slos_failures_and_missing_records_as_misses():
    good = outcome_of(record(4000.0, 4000.0 + 47 * 200.0))
    slow_first = outcome_of(record(6000.0, 6000.0 + 47 * 100.0))  # TTFT over
    slow_decode = outcome_of(record(1000.0, 1000.0 + 47 * 300.0))  # TPOT over
    outcomes = [good, good, slow_first, slow_decode, outcome_of(FAILED)]
    assert attainment(outcomes, SLO, sent=5) == pytest.approx(0.4)
    assert attainment(outcomes, SLO, sent=10) == pytest.approx(0.2)  # five never came back
    assert attainment([], SLO, sent=0) == 0.0
    s = summarize(outcomes, SLO, sent=6)
    assert s["sent"] == 6 and s["failed"] == 2 and s["attainment"] == pytest.approx(2 / 6, abs=1e-4)
    assert s["ttft_p50_s"] == 4.0 and s["tpot_p90_s"] == pytest.approx(0.3)
    assert s["prompt_tokens_mean"] is None  # the records carry no prompt length


def test_the_step_reports_the_prompt_the_server_counted():
    """`pdserve plan --input-len` is the server's count (chat template included), not AIPerf's
    content length: the step reports the mean over the completed requests, failures left out."""
    outcomes = [outcome_of(record(100.0, 200.0, prompt=76)), outcome_of(record(100.0, 200.0, prompt=80))]
    assert outcomes[0].prompt_tokens == 76
    assert summarize([*outcomes, outcome_of(FAILED)], SLO, sent=3)["prompt_tokens_mean"] == 78.0


def test_failures_are_counted_by_what_aiperf_recorded():
    refused = {"error": {"code": 503, "type": "Service Unavailable", "message": "no  decode\nnode has room"}}
    records = [refused, refused, {"error": "read timeout"}, {"metrics": {}}]
    assert failure_reasons(records) == {"503 Service Unavailable: no decode node has room": 2, "read timeout": 1}
    assert failure_reasons(records, limit=1) == {"503 Service Unavailable: no decode node has room": 2}
    assert failure_reasons([{"metrics": {}}]) == {}


def test_warmup_records_are_left_out():
    records = [record(1.0, 2.0, phase="warmup"), record(1.0, 2.0), FAILED]
    assert len(profiling_records(records)) == 2


def test_slo_rejects_bad_values_naming_the_flag():
    with pytest.raises(ValueError, match="--ttft-slo"):
        Slo(0.0, 0.25)
    with pytest.raises(ValueError, match="--tpot-slo"):
        Slo(5.0, -1.0)
    with pytest.raises(ValueError, match="--attainment"):
        Slo(5.0, 0.25, attainment=1.5)


def capacity(limit: float):
    """A server whose attainment is 1.0 up to `limit` req/s and 0.5 above it."""
    calls: list[float] = []

    def measure(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= limit else 0.5

    return measure, calls


def test_search_brackets_then_bisects_to_within_the_tolerance():
    measure, calls = capacity(0.33)
    found = search_goodput(measure, start=0.1, max_steps=20, threshold=0.9, rel_tol=0.05)
    assert calls[:3] == [0.1, 0.2, 0.4]  # doubling until a failure
    assert 0.33 / 1.05 <= found.goodput <= 0.33 < found.lowest_fail <= 0.33 * 1.05
    assert [s.passed for s in found.steps] == [c <= 0.33 for c in calls]


def test_search_goes_down_when_the_first_rate_fails_and_reports_zero_if_nothing_passes():
    measure, calls = capacity(0.03)
    found = search_goodput(measure, start=0.1, max_steps=3, threshold=0.9)
    assert calls == [0.1, 0.05, 0.025] and found.goodput == 0.025
    never, _ = capacity(-1.0)
    assert search_goodput(never, start=0.1, max_steps=4, threshold=0.9).goodput == 0.0


def test_search_is_bounded_by_max_steps_and_checks_its_arguments():
    measure, calls = capacity(1e9)
    found = search_goodput(measure, start=0.1, max_steps=3, threshold=0.9)
    assert len(calls) == 3 and found.goodput == pytest.approx(0.4) and found.lowest_fail is None
    with pytest.raises(ValueError, match="--start-rate"):
        search_goodput(measure, start=0.0, max_steps=3, threshold=0.9)
    with pytest.raises(ValueError, match="--max-steps"):
        search_goodput(measure, start=0.1, max_steps=0, threshold=0.9)


def test_shapes_parse_with_threads_and_bad_ones_name_the_flag():
    shapes = parse_shapes("1p1d, 0p1d,2p2d@1")
    assert shapes == [Shape(1, 1), Shape(0, 1), Shape(2, 2, 1)]
    assert [s.name for s in shapes] == ["1p1d", "0p1d", "2p2d@1"]
    assert shapes[0].up_args() == ["--num-prefill", "1", "--num-decode", "1", "--num-threads", "auto"]
    assert shapes[2].up_args()[-1] == "1"
    for bad, why in (("1p0d", "no decode"), ("2p2", "PpDd"), ("1p1d,1p1d", "twice"), ("1p1d@0", "threads")):
        with pytest.raises(ValueError, match=f"--shapes.*{why}"):
            parse_shapes(bad)


def test_a_slo_shape_tells_up_the_slos_and_is_a_target_of_its_own():
    plain, told = parse_shapes("1p1d@1,1p1d@1+slo")
    assert told == Shape(1, 1, 1, told_slo=True) and told.name == "1p1d@1+slo"
    assert told.up_args(SLO)[-4:] == ["--ttft-slo", "5", "--tpot-slo", "0.25"]
    assert "--tpot-slo" not in plain.up_args(SLO)
    with pytest.raises(ValueError, match="needs the SLOs"):
        told.up_args()
    with pytest.raises(ValueError, match="--shapes"):
        parse_shapes("1p1d+SLO")


def write_lines(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    lines = [json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) for t, i, o, h in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


TRACE_ROWS = [
    (0, 6000, 400, list(range(12))),
    (0, 1500, 100, [0, 12, 13]),
    (2000, 12000, 300, [0] + list(range(14, 37))),
    (6000, 700, 10, [37, 38]),
    (10000, 4800, 200, list(range(39, 49))),
]


def test_a_trace_out_of_order_is_refused_naming_the_flag_and_line(tmp_path):
    rows = TRACE_ROWS[:3] + [(1000, 700, 10, [37, 38])]
    with pytest.raises(ValueError, match=r"--trace .*out of order at line 4 \(1000 ms after 2000 ms\)"):
        load_trace(write_lines(tmp_path / "t.jsonl", rows))
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="--trace .*line 1 is not a trace record"):
        load_trace(tmp_path / "bad.jsonl")


def test_trace_scaling_keeps_the_arrival_pattern_and_scales_lengths_to_the_model(tmp_path):
    trace = load_trace(write_lines(tmp_path / "t.jsonl", TRACE_ROWS))
    assert len(load_trace(tmp_path / "t.jsonl", limit=2)) == 2
    assert native_rate(trace) == pytest.approx(4 / 10.0)
    scaled = scale_trace(trace, rate=0.1, input_mean=500, output_mean=50, max_context=2048)
    times = [r["timestamp"] for r in scaled.records]
    assert scaled.time_factor == pytest.approx(4.0) and times == [0, 0, 8000, 24000, 40000]
    inputs = [r["input_length"] for r in scaled.records]
    assert sum(inputs) / len(inputs) == pytest.approx(500, rel=0.01)
    assert sum(r["output_length"] for r in scaled.records) / 5 == pytest.approx(50, rel=0.05)
    for r in scaled.records:  # AIPerf's rule: the last id is a block of 1..block_size tokens
        n = len(r["hash_ids"])
        assert 0 < r["input_length"] - (n - 1) * scaled.block_size <= scaled.block_size
    assert scaled.records[1]["hash_ids"][0] == scaled.records[0]["hash_ids"][0] == 0  # a shared prefix stays
    tight = scale_trace(trace, rate=0.1, input_mean=2000, output_mean=50, max_context=2048)
    # the chat template's tokens come on top of a prompt: a request filling the context is refused
    assert tight.clipped >= 1 and all(r["input_length"] + r["output_length"] <= 2048 - 64 for r in tight.records)
    with pytest.raises(ValueError, match="--max-context 65 leaves no room"):
        scale_trace(trace, rate=0.1, input_mean=500, output_mean=50, max_context=65)


def test_the_shared_conversation_trace_loads_in_order():
    path = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        path = ROOT.parents[1] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("../shared/traces is not on this machine")
    trace = load_trace(path, limit=200)
    scaled = scale_trace(trace, 0.2, 800, 48, 4096)
    assert len(scaled.records) == 200 and scaled.clipped < 20  # its long tail is cut to the context
    assert all(r["input_length"] + r["output_length"] <= 4096 - 64 for r in scaled.records)


def test_result_line_takes_the_best_shape_against_vllm():
    def rounds(*goodputs: float | None) -> list[dict]:
        return [{"goodput": g, "steps": [{"rate": 0.1, "attainment": 0.95}]} for g in goodputs]

    line = result_line(
        {"1p2d": rounds(0.05, 0.0, 0.05), "0p1d": rounds(0.1, 0.2, 0.12), "vllm": rounds(0.1, 0.08, 0.1)}, "vllm"
    )
    assert line["metric"] == "goodput_req_s" and line["target"] == 1.3
    assert line["best_shape"] == "0p1d" and line["value"] == 0.12 and line["baseline"] == 0.1
    assert line["ratio"] == 1.2 and line["met"] is False
    assert line["shapes"]["1p2d"]["goodput_per_round"] == [0.05, 0.0, 0.05]
    assert line["shapes"]["vllm"]["attainment_by_rate"] == {"0.1": [0.95, 0.95, 0.95]}
    zero = result_line({"1p1d": rounds(0.1, 0.1, 0.1), "vllm": rounds(0.0, 0.0, 0.05)}, "vllm")
    assert zero["baseline"] == 0.0 and zero["ratio"] is None and zero["met"] is True
    assert result_line({"1p1d": rounds(0.0), "vllm": rounds(0.0)}, "vllm")["met"] is False
    alone = result_line({"1p1d": rounds(0.2, None, 0.3)}, None)
    assert alone["value"] == 0.25 and alone["baseline"] is None and alone["ratio"] is None


FAKE = """#!{python}
import json, os, sys
argv = sys.argv[1:]
json.dump(argv, open(os.environ["FAKE_ARGV"], "w"))
out = argv[argv.index("--output-artifact-dir") + 1]
rows = [{rows}]
open(os.path.join(out, "profile_export.jsonl"), "w").write("".join(json.dumps(r) + "\\n" for r in rows))
"""


def fake_aiperf(tmp_path: Path, rows: list[dict], monkeypatch) -> Client:
    """A client whose `aiperf` writes `rows` as its records (and its argv to $FAKE_ARGV)."""
    script = tmp_path / "aiperf"
    script.write_text(FAKE.format(python=sys.executable, rows=", ".join(repr(r) for r in rows)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    return Client(str(script), "http://127.0.0.1:9", "bench", "/models/bench", 30.0, tmp_path / "keep")


def test_one_step_through_a_stand_in_aiperf(tmp_path, monkeypatch):
    rows = [record(1000.0, 1000.0 + 47 * 100.0), record(9000.0, 9500.0), FAILED, record(1.0, 2.0, phase="warmup")]
    client = fake_aiperf(tmp_path, rows, monkeypatch)
    got = measure_step(client, poisson_args(0.25, 4, 800, 48, 0), "1p1d/round0/rate0.25", SLO, 4, 60)
    assert got["attainment"] == 0.25 and got["sent"] == 4 and got["failed"] == 2  # 1 ok, 1 slow, 1 failed, 1 lost
    flags = dict(zip(argv := json.loads((tmp_path / "argv.json").read_text()), argv[1:]))
    assert flags["--request-rate"] == "0.25" and flags["--arrival-pattern"] == "poisson"
    assert flags["--request-count"] == "4" and flags["--prompt-input-tokens-mean"] == "800"
    assert flags["--request-timeout-seconds"] == "30" and "--streaming" in argv
    assert (tmp_path / "keep" / "1p1d" / "round0" / "rate0.25" / "profile_export.jsonl").exists()
    trace = load_trace(write_lines(tmp_path / "t.jsonl", TRACE_ROWS))
    scaled = scale_trace(trace, 0.1, 800, 48, 4096)
    args = trace_args(write_trace(scaled, tmp_path / "s.jsonl"), scaled, 0)
    assert "--fixed-schedule" in args and args[args.index("--custom-dataset-type") + 1] == "mooncake_trace"
    assert args[args.index("--prompt-input-tokens-block-size") + 1] == str(scaled.block_size)
    monkeypatch.setenv("PATH", "/nonexistent")
    broken = Client(str(tmp_path / "missing"), "http://127.0.0.1:9", "bench", "/m", 30.0)
    failed = measure_step(broken, [], "x", SLO, 3, 10)
    assert failed["attainment"] == 0.0 and failed["failed"] == 3 and failed["error"]


@pytest.mark.skipif(not CpuSampler.available(), reason="needs Linux /proc")
def test_a_step_records_the_cpu_of_its_window_from_the_first_request_sent_to_the_last_answered(tmp_path, monkeypatch):
    start = time.time_ns()
    rows = [record(100.0, 300.0), record(100.0, 300.0)]
    for k, row in enumerate(rows):
        row["metadata"] |= {"request_start_ns": start + k * 100_000_000, "request_end_ns": start + 400_000_000}
    with CpuSampler(os.getpid(), interval_s=0.05) as cpu:
        time.sleep(0.5)
        got = measure_step(fake_aiperf(tmp_path, rows, monkeypatch), [], "x", SLO, 2, 60, cpu)
    assert got["attainment"] == 1.0
    assert got["host_cpu"]["wall_s"] == 0.4 and got["host_cpu"]["host_cpu_ms_per_request"] >= 0
    assert "host_cpu" not in measure_step(fake_aiperf(tmp_path, rows, monkeypatch), [], "x", SLO, 2, 60)


def test_the_cli_refuses_an_out_of_order_trace_before_starting_anything(tmp_path):
    trace = write_lines(tmp_path / "t.jsonl", [(5, 100, 10, [0]), (1, 100, 10, [1])])
    cmd = [sys.executable, "-m", "benchmarks.goodput", "--trace", str(trace), "--aiperf", "/nonexistent"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--trace" in run.stderr and "out of order" in run.stderr
    for flags, named in ((["--shapes", "1p0d"], "--shapes"), (["--requests", "0"], "--requests")):
        bad = subprocess.run(cmd[:3] + flags, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr
    bad = subprocess.run(cmd[:3] + ["--ttft-slo", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ttft-slo" in bad.stderr
    missing = subprocess.run(cmd[:3] + ["--aiperf", str(tmp_path / "none")], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "AIPerf not found" in missing.stderr and "pip install aiperf" in missing.stderr


def test_step_seconds_sends_at_least_rate_times_that_many_requests_and_is_for_poisson_only(tmp_path):
    args = build_parser().parse_args(["--preset", "honest", "--requests", "32", "--step-seconds", "20"])
    args.max_context = 4096
    plan = make_plan(args, None, tmp_path)
    assert plan.load(1.0, 0, 1).sent == 32  # 20 s at 1 req/s is fewer than --requests
    at_ten = plan.load(10.0, 0, 1)
    assert at_ten.sent == 200 and at_ten.args[at_ten.args.index("--request-count") + 1] == "200"
    assert at_ten.timeout_s > 3 * 200 / 10.0  # the run's bound grows with it
    args.step_seconds = -1.0
    with pytest.raises(ValueError, match="--step-seconds must be >= 0"):
        make_plan(args, None, tmp_path)
    args.step_seconds = 20.0
    trace = load_trace(write_lines(tmp_path / "t.jsonl", TRACE_ROWS))
    with pytest.raises(ValueError, match="--step-seconds .* Poisson loads only"):
        make_plan(args, trace, tmp_path)


def test_the_tokenizer_is_found_offline_as_a_hub_id_in_the_throwaway_cache(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    cache = local_hub_cache(model, tmp_path / "hf")
    assert local_hub_cache(model, tmp_path / "hf") == cache  # a second call finds it made
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    found = huggingface_hub.snapshot_download(HUB_ID, cache_dir=cache, local_files_only=True)
    assert (Path(found) / "tokenizer.json").read_text() == "{}"
