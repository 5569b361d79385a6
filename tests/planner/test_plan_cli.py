"""`pdserve plan` end to end (in process): a plan in text and JSON, a measured profile, and each bad
input refused with exit code 2 and a message naming its flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.planner.config import SimConfig
from pdserve.planner.measure import measure_profile
from pdserve.planner.workload import from_lengths


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """A small GPU table named like the TD-Pipe ones: hardware T4, model toy."""
    path = tmp_path / "T4-toy.csv"
    path.write_text("Total Length,Execute Time\n1,20.1\n4096,430\n")
    return path


def plan(*argv: str, table: Path | None = None) -> list[str]:
    base = ["plan", "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--num-requests", "60", "--gpus-per-node", "2"]
    return base + (["--profile", str(table)] if table else []) + list(argv)


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_plan_names_the_shape_its_modelled_goodput_and_the_runners_up(table: Path, capsys) -> None:
    assert main(plan("--input-len", "400", "--output-len", "20", table=table)) == 0
    out = capsys.readouterr().out
    assert "profile: toy on T4, per GPU" in out and "recommended: " in out
    assert "predicted goodput (modelled): " in out and "goodput req/s (modelled)" in out
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3  # on 2 GPUs: 1P:1D, 0P:2D(tp1), 0P:1D(tp2)


def test_json_holds_every_shape_searched(table: Path, capsys) -> None:
    assert main(plan("--input-len", "400", "--output-len", "20", "--json", table=table)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["modelled"] is True and data["profile"] == {"model": "toy", "hardware": "T4", "unit": "gpu"}
    assert data["recommended"] == data["shapes"][0] and data["recommended"]["goodput_rps"] > 0
    assert {s["shape"] for s in data["shapes"]} == {"1P(tp1):1D(tp1)", "0P:2D(tp1) colocated", "0P:1D(tp2) colocated"}
    per_unit = [s["goodput_per_unit_rps"] for s in data["shapes"]]
    assert per_unit == sorted(per_unit, reverse=True)


def test_a_trace_is_a_workload(table: Path, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": 100 * i, "input_length": 300, "output_length": 10}) + "\n" for i in range(30))
    )
    assert main(plan("--trace", str(trace), "--arrival", "trace", "--json", table=table)) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["requests"] == 30


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--ttft-slo", "0"], "--ttft-slo must be > 0"),
        (["--tpot-slo", "-1"], "--tpot-slo must be > 0"),
        (["--gpus-per-node", "1"], "--gpus-per-node 1 x --nodes 1: 1 GPU cannot hold one prefill and one decode node"),
        (["--model", "Llama-13B"], "--model: the profile is for 'toy'"),
        (["--cores", "4"], "--cores: the profile is per GPU"),
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--prefill-saturated-tokens", "-1"], "--prefill-saturated-tokens: prefill_saturated_tokens must be >= 0"),
        (["--local-prefill-max-tokens", "-2"], "--local-prefill-max-tokens: local_prefill_max_tokens must be >= 0"),
        (["--host-cpu-ms-per-request", "-1"], "--host-cpu-ms-per-request: host_cpu_ms_per_request must be >= 0"),
        (["--host-cpu-ms-per-request", "30"], "--host-cpu-ms-per-request: the profile is per GPU"),
    ],
)
def test_bad_input_is_refused_naming_the_flag(table: Path, capsys, argv: list[str], flag: str) -> None:
    err = refused(plan("--input-len", "400", "--output-len", "20", *argv, table=table), capsys)
    assert flag in err


def test_slos_no_shape_meets_are_refused_with_the_closest_shape(table: Path, capsys) -> None:
    err = refused(plan("--input-len", "400", "--output-len", "20", "--tpot-slo", "0.001", table=table), capsys)
    assert "--tpot-slo 0.001: no shape within the budget meets them" in err
    assert "the closest shape, " in err and "the lowest rate searched" in err


def test_a_trace_out_of_order_is_refused_naming_the_flag(table: Path, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 30, "output_length": 3}) + "\n" for t in (0, 9, 8))
    )
    err = refused(plan("--trace", str(trace), table=table), capsys)
    assert "--trace: " in err and "line 3: timestamp 8 is before the previous line's 9" in err


def test_a_workload_and_a_profile_are_required(table: Path, capsys) -> None:
    assert "--input-len and --output-len (or --trace) are required" in refused(plan(table=table), capsys)
    assert "give one of --profile and --measure" in refused(plan("--input-len", "9", "--output-len", "9"), capsys)


def test_a_core_profile_needs_cores_and_at_least_two(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    work = from_lengths(32, 8, 0.5, 8, seed=0)
    profile = measure_profile(tiny_model_dir, [1], work, SimConfig(max_batch_tokens=64, kv_tokens=256), quick=True)
    assert profile.unit == "core" and profile.model == tiny_model_dir.name and profile.tables[1].tokens[-1] == 64
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(profile.to_json()))
    argv = ["plan", "--profile", str(path), "--ttft-slo", "1", "--tpot-slo", "0.1", "--input-len", "32"]
    argv += ["--output-len", "8", "--num-requests", "30"]
    assert "--cores: the profile was measured on CPU cores" in refused(argv, capsys)
    assert "--cores 1: the budget cannot hold one prefill and one decode node" in refused(
        argv + ["--cores", "1"], capsys
    )
    assert main(argv + ["--cores", "2", "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "per core; profiled degrees 1, others modelled" in out and "modelled (Amdahl)" in out
    assert main(argv + ["--cores", "2", "--host-cpu-ms-per-request", "5", "--json"]) == 0
    with_host = json.loads(capsys.readouterr().out)["recommended"]["goodput_rps"]
    assert main(argv + ["--cores", "2", "--json"]) == 0
    assert 0 < with_host < json.loads(capsys.readouterr().out)["recommended"]["goodput_rps"]


def test_measure_writes_a_profile_for_each_thread_count_and_plans_with_it(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    path = tmp_path / "local.json"
    argv = ["plan", "--measure", str(path), "--model", str(tiny_model_dir), "--cores", "2", "--ttft-slo", "1"]
    argv += [
        "--tpot-slo",
        "0.1",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--num-requests",
        "20",
        "--max-batch-tokens",
        "64",
    ]
    assert main(argv + ["--kv-tokens", "512"]) == 0
    saved = json.loads(path.read_text())
    assert saved["unit"] == "core" and set(saved["tables"]) == {"1", "2"}
    # the KV slope travels with each table (empty where the profiler measured none above noise)
    assert all(len(t["decode_kv_ms"]) <= 1 and t["decode_context"] >= 0 for t in saved["tables"].values())
    assert "recommended: " in capsys.readouterr().out
