"""benchmarks/trace_replay.py on a small synthetic conversation trace: the router's index follows the
simulated nodes exactly, kv-aware routing beats WRR on prefix hits there, and the policy weights
are fitted on the trace's first half and judged on its second, every figure labelled modelled."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from benchmarks.trace_replay import FIT_GRID, candidates, fit, infinite_cache_bound, load_trace, split_halves
from benchmarks.trace_sim import CostModel, simulate
from pdserve.router.kv_policy import PolicyParams
from pdserve.router.kv_routing import KvRouter

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path, sessions: int = 24, turns: int = 5) -> None:
    """Chats of growing prompts (each turn = the previous prompt + 2 new blocks), interleaved in time."""
    rng = random.Random(0)
    next_id, lines = 1, []
    for s in range(sessions):
        ids = [0]  # a shared system prompt block
        for t in range(turns):
            ids = ids + [next_id, next_id + 1]
            next_id += 2
            lines.append((s * 700 + t * 4000 + rng.randrange(300), len(ids) * 512 - 100, 40, list(ids)))
    lines.sort()
    with path.open("w") as f:
        for ts, n, out, ids in lines:
            f.write(json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}) + "\n")


def test_index_matches_the_nodes_caches_after_a_replay(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    requests = load_trace(tmp_path / "t.jsonl", None)
    router = KvRouter(seed=0)
    nodes = simulate(requests, "kv-aware", 3, 40, CostModel(), router)  # small pools: evictions happen
    for n in nodes:
        held = set(n.blocks.hash_to_block)
        assert {k for k in held if router.index.match([k], [n.address])[n.address]} == held
        assert router.index.node_size(n.address) == len(held)
        n.blocks.check_integrity()
    assert all(r.ttft > 0 for r in requests)
    assert 0 < infinite_cache_bound(requests) <= 1


def test_cli_compares_kv_aware_with_wrr(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.trace_replay", "--trace", str(tmp_path / "t.jsonl"), "--nodes", "3"]
    proc = subprocess.run(cmd + ["--node-blocks", "200"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("metric", "value", "baseline", "ratio", "target", "prefix_hit", "wrr_prefix_hit", "bound"):
        assert key in result
    assert result["wrr_prefix_hit"] < result["prefix_hit"] <= result["bound"]
    assert result["max_over_mean"] >= 1.0


def test_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.trace_replay", "--trace", str(tmp_path / "none.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not found" in proc.stderr


def test_halves_split_the_trace_in_time_and_reindex_the_second(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    requests = load_trace(tmp_path / "t.jsonl", None)
    first, second = split_halves(requests)
    assert len(first) + len(second) == len(requests) and len(first) == len(requests) // 2
    assert max(r.arrival for r in first) <= min(r.arrival for r in second)
    assert [r.index for r in second] == list(range(len(second)))  # the simulator's requests[i].index == i
    assert second[0].tokens == requests[len(first)].tokens and requests[len(first)].index == len(first)


def test_fit_picks_the_lowest_score_from_the_grid_only() -> None:
    base = PolicyParams(miss_weight=2.0)
    options = candidates(base, {"load_weight": (0.1, 1.0), "queue_weight": (0.3, 0.03, 3.0)})
    assert len(options) == 6 and all(p.miss_weight == 2.0 for p in options)
    assert {(p.load_weight, p.queue_weight) for p in options} == {(a, b) for a in (0.1, 1.0) for b in (0.3, 0.03, 3.0)}
    best, scores = fit(options, lambda p: abs(p.load_weight - 1.0) + abs(p.queue_weight - 0.3))
    assert (best.load_weight, best.queue_weight) == (1.0, 0.3) and len(scores) == 6 and min(scores) == 0.0
    # equal scores: the first option wins (a deterministic choice)
    assert fit(options, lambda p: 1.0)[0] == options[0]


def test_every_figure_is_labelled_modelled_and_both_halves_are_reported(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.trace_replay", "--trace", str(tmp_path / "t.jsonl"), "--nodes", "3"]
    proc = subprocess.run(cmd + ["--node-blocks", "200"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *lines, last = proc.stdout.strip().splitlines()
    assert all("modelled" in line for line in lines if "ttft" in line.lower())
    result = json.loads(last)
    assert "modelled" in result["metric"] and result["modelled"] is True
    assert set(result["fitted_params"]) == set(FIT_GRID) and result["held_out_requests"] == 60
    for half in (result, result["fit_half"]):
        assert half["wrr_prefix_hit"] < half["prefix_hit"] <= half["bound"]
    assert result["ratio"] == round(result["value"] / result["baseline"], 3)
    assert set(result["default_params_held_out"]) >= {"ttft_p50", "ratio"}
