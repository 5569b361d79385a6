"""benchmarks/trace_replay.py on a small synthetic conversation trace: the router's index follows the
simulated nodes exactly, and kv-aware routing beats WRR on prefix hits there."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from benchmarks.trace_replay import infinite_cache_bound, load_trace
from benchmarks.trace_sim import CostModel, simulate
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
