"""benchmarks/common.py's alternation of a comparison's arms over rounds and the medians it reports."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.common import Rounds, add_rounds_arg, alternate, arm_order, last_error_line, median_figures


def test_arm_order_alternates_which_arm_goes_first() -> None:
    assert [arm_order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert arm_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_alternate_runs_every_arm_each_round_in_alternating_order() -> None:
    calls: list[str] = []
    figures = {"a": iter([1.0, 3.0, 2.0]), "b": iter([10.0, 20.0, 40.0])}

    def arm(name: str):
        return lambda: calls.append(name) or {"x": next(figures[name])}

    runs = alternate({"a": arm("a"), "b": arm("b")}, 3, log=lambda _: None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [f["x"] for f in runs.of("a")] == [1.0, 3.0, 2.0]
    # paired per round: 1/10, 3/20, 2/40
    assert runs.ratios("a", "b", "x") == pytest.approx([0.1, 0.15, 0.05])
    assert runs.errors == {}


def test_an_optional_arm_that_fails_is_recorded_and_left_out_of_later_rounds() -> None:
    tries = {"peer": 0}

    def peer() -> dict:
        tries["peer"] += 1
        if tries["peer"] == 2:
            raise RuntimeError("vllm serve exited before it was ready:\nINFO noise\nValueError: bad block size\nbye")
        return {"x": 2.0}

    runs = alternate({"ours": lambda: {"x": 1.0}, "peer": peer}, 4, optional={"peer"}, log=lambda _: None)
    assert tries["peer"] == 2 and len(runs.of("ours")) == 4 and len(runs.of("peer")) == 1
    assert runs.errors == {"peer": "ValueError: bad block size"}
    assert runs.ratios("ours", "peer", "x") == [0.5]  # only the round both ran


def test_a_failing_arm_that_is_not_optional_propagates() -> None:
    def broken() -> dict:
        raise RuntimeError("pdserve did not start")

    with pytest.raises(RuntimeError, match="did not start"):
        alternate({"ours": broken, "peer": lambda: {}}, 3, optional={"peer"}, log=lambda _: None)


def test_median_figures_takes_each_numbers_median_and_ands_the_flags() -> None:
    rounds = [
        {"tok_s": 3.0, "n": 1, "same": True, "name": "a"},
        {"tok_s": 1.0, "n": 5, "same": False, "name": "b"},
        {"tok_s": 2.0, "n": 3, "same": True, "name": "c"},
    ]
    assert median_figures(rounds) == {"tok_s": 2.0, "n": 3, "same": False, "name": "a"}
    assert median_figures([]) == {}
    # an even count: the mean of the middle two
    assert median_figures([{"x": 1.0}, {"x": 4.0}])["x"] == 2.5


def test_ratios_skip_a_zero_baseline() -> None:
    runs = Rounds([{"a": {"x": 1.0}, "b": {"x": 0.0}}, {"a": {"x": 1.0}, "b": {"x": 4.0}}], {})
    assert runs.ratios("a", "b", "x") == [0.25]


def test_rounds_flag_defaults_to_three_and_refuses_zero(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_rounds_arg(parser)
    assert parser.parse_args([]).rounds == 3 and parser.parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_last_error_line_names_the_error() -> None:
    assert last_error_line(RuntimeError("start\nKeyError: 'x'\nshutting down")) == "KeyError: 'x'"
    assert last_error_line(RuntimeError("")) == "RuntimeError"


def test_itl_isolation_gives_both_arms_the_same_cores() -> None:
    from benchmarks.itl_isolation import node_args, shares

    split = shares([0, 1])
    assert split["prefill"].cpus | split["decode"].cpus == split["colocated"].cpus == frozenset({0, 1})
    assert split["prefill"].threads + split["decode"].threads == split["colocated"].threads == 2
    four = shares([4, 5, 6, 7])
    assert four["prefill"].threads + four["decode"].threads == four["colocated"].threads == 4
    assert shares([3])["colocated"] == shares([3])["decode"]  # one CPU: one thread each, unpinned
    assert node_args(["--port", "0", "--num-threads", "1", "--x"], split["colocated"]) == [
        "--port", "0", "--num-threads", "2", "--x"
    ]  # fmt: skip


def test_a_server_that_never_gets_ready_is_killed_at_its_timeout() -> None:
    import sys

    from benchmarks.multiturn_servers import start_server

    cmd = [sys.executable, "-c", "import time; print('compiling', flush=True); time.sleep(60)"]
    with pytest.raises(RuntimeError, match=r"not ready after 1 s: killed\).*\n.*compiling"):
        start_server(cmd, lambda line: "ready" in line, timeout=1.0)


def test_a_paired_sweep_alternates_the_first_mode_and_pairs_each_size_per_round() -> None:
    import asyncio

    from benchmarks.local_prefill import paired_sweep, sweep_json, sweep_medians

    calls: list[tuple[str, int, int]] = []
    seconds = {
        ("a", 1): [0.1, 0.3, 0.2],
        ("b", 1): [0.2, 0.2, 0.8],
        ("a", 4): [1.0, 1.0, 1.0],
        ("b", 4): [0.5, 2.0, 4.0],
    }

    async def measure(mode: str, size: int, r: int) -> float:
        calls.append((mode, size, r))
        return seconds[mode, size][r]

    runs = asyncio.run(paired_sweep([1, 4], 3, ("a", "b"), measure))
    assert calls == [
        ("a", 1, 0), ("b", 1, 0), ("a", 4, 0), ("b", 4, 0),
        ("b", 1, 1), ("a", 1, 1), ("b", 4, 1), ("a", 4, 1),
        ("a", 1, 2), ("b", 1, 2), ("a", 4, 2), ("b", 4, 2),
    ]  # fmt: skip
    assert sweep_medians(runs) == {1: {"a": 0.2, "b": 0.2}, 4: {"a": 1.0, "b": 2.0}}
    out = sweep_json(runs, ("a", "b"))
    assert out["a_ttft_ms"] == {1: 200.0, 4: 1000.0} and out["b_ttft_ms"] == {1: 200.0, 4: 2000.0}
    # paired per round, then the median: size 1 -> 0.5, 1.5, 0.25; size 4 -> 2, 0.5, 0.25
    assert out["a_over_b"] == {1: 0.5, 4: 0.5}
    assert out["rounds_ttft_ms"][1] == {"a": {"1": 300.0, "4": 1000.0}, "b": {"1": 200.0, "4": 2000.0}}


def test_overload_queue_wait_p99_counts_only_the_waits_between_two_readings() -> None:
    from benchmarks.overload_burst import queue_wait_p99

    before = {0.1: 50.0, 1.0: 60.0, 30.5: 60.0, float("inf"): 60.0}
    # 100 new waits: 90 under 0.1 s, 9 up to 1 s, 1 up to 30.5 s
    after = {0.1: 140.0, 1.0: 159.0, 30.5: 160.0, float("inf"): 160.0}
    assert queue_wait_p99(before, after) == (1.0, 100)
    after[1.0] = 150.0  # now 10 of the 100 waited over 1 s: the 99th is in the 30.5 s bucket
    assert queue_wait_p99(before, after) == (30.5, 100)
    assert queue_wait_p99({}, {}) == (0.0, 0)  # no histogram yet
    assert queue_wait_p99(after, after) == (0.0, 0)  # nobody waited in between
