"""KV tiers in benchmarks/trace_sim.py and trace_replay.py --tiers (issue 49): hand-computed host and
store hits on tiny traces, the router's tiered index following the simulated tiers exactly, and the
replay with tiers off unchanged (figures pinned from the code before the tiers)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.trace_replay import load_trace
from benchmarks.trace_sim import BLOCK, ROOT, TRACE_BLOCK_TOKENS, CostModel, SimRequest, simulate
from pdserve.engine.block_keys import prompt_block_keys
from pdserve.engine.kv_events import Medium
from pdserve.router.kv_routing import KvRouter
from pdserve.router.kv_tiers import TieredKvIndex
from tests.benchmarks.test_trace_replay import write_trace

REPO = Path(__file__).resolve().parents[2]
COST = CostModel(host_restore_s=0.25, store_restore_s=0.5)  # large: a restore shows in the TTFT


def chat(path: Path, turns: Sequence[tuple[float, list[int], int]]) -> list[SimRequest]:
    """A trace of (seconds, block ids, output tokens); every prompt is exactly its blocks (no partial
    last block), so a request that gets all its blocks has nothing to prefill."""
    with path.open("w") as f:
        for ts, ids, out in turns:
            rec = {"timestamp": ts * 1000, "input_length": len(ids) * TRACE_BLOCK_TOKENS, "output_length": out}
            f.write(json.dumps(rec | {"hash_ids": ids}) + "\n")
    return load_trace(path, None)


def test_evicted_blocks_come_back_from_the_host_tier(tmp_path: Path) -> None:
    # One node whose pool holds one request (3 prompt blocks + the last token's + 1 output = 5).
    # B evicts A's three blocks into the host tier; C (A's prompt again) evicts B's and finds A's
    # there: 3 host hits, nothing computed, its TTFT the overhead + 3 host restores.
    turns = [(0, [1, 2, 3], 10), (100, [4, 5, 6], 10), (200, [1, 2, 3], 10)]
    for host, want in ((6, 3), (3, 0)):  # 3 slots: B's evictions push A's out (LRU) before C looks
        reqs = chat(tmp_path / "t.jsonl", turns)
        simulate(reqs, "kv-aware", 1, 5, COST, KvRouter(seed=0), host_blocks=host)
        a, b, c = reqs
        assert (a.hit_blocks, a.host_hits, b.hit_blocks, b.host_hits) == (0, 0, 0, 0)
        assert (c.hit_blocks, c.host_hits, c.store_hits) == (0, want, 0)
        assert c.uncached == (3 - want) * TRACE_BLOCK_TOKENS
        prefill = c.uncached / COST.prefill_tok_s
        assert abs(c.ttft - (COST.overhead + prefill + want * COST.host_restore_s)) < 1e-9
    # tiers off: C recomputes everything
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 1, 5, COST, KvRouter(seed=0))
    assert (reqs[2].hit_blocks, reqs[2].host_hits, reqs[2].uncached) == (0, 0, 3 * TRACE_BLOCK_TOKENS)


def test_the_pool_goes_before_the_host_tier_before_the_store_and_a_miss_ends_the_run(tmp_path: Path) -> None:
    # Pool of 9 blocks: A (3 prompt blocks, 5 pool blocks) and B (2 blocks, 4 pool blocks) fill it;
    # C ([7, 8]: 4 pool blocks) takes A's two unkeyed blocks and evicts A's blocks 3 and 2 (the last
    # first) into the host tier. The store holds every block. D = [1, 2, 3, 9]: block 1 from the
    # pool, 2 and 3 from the host tier (both also in the store), 9 is nowhere: prefilled.
    turns = [(0, [1, 2, 3], 10), (100, [4, 5], 10), (200, [7, 8], 10), (300, [1, 2, 3, 9], 10)]
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 1, 9, COST, KvRouter(seed=0), host_blocks=100, store_blocks=100)
    d = reqs[3]
    assert (d.hit_blocks, d.host_hits, d.store_hits, d.uncached) == (1, 2, 0, TRACE_BLOCK_TOKENS)
    want = COST.overhead + TRACE_BLOCK_TOKENS / COST.prefill_tok_s + 2 * COST.host_restore_s
    assert abs(d.ttft - want) < 1e-9
    # without the host tier the same two blocks come from the store, at its price
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 1, 9, COST, KvRouter(seed=0), store_blocks=100)
    assert (reqs[3].hit_blocks, reqs[3].host_hits, reqs[3].store_hits) == (1, 0, 2)


def test_a_store_hit_counts_for_a_node_that_never_computed_the_block(tmp_path: Path) -> None:
    # Two nodes whose pools hold one request each. A runs long on one node; B (A's prompt) cannot
    # fit there, so it goes to the other node, which never computed A's blocks: they come from the
    # store, which A's node wrote them to when it computed them.
    turns = [(0, [1, 2, 3], 500), (1, [1, 2, 3], 10)]
    reqs = chat(tmp_path / "t.jsonl", turns)
    router = KvRouter(seed=0)
    nodes = simulate(reqs, "kv-aware", 2, 5, COST, router, store_blocks=100)
    a, b = reqs
    assert a.node != b.node and nodes[b.node].requests == 1
    assert (b.hit_blocks, b.host_hits, b.store_hits, b.uncached) == (0, 0, 3, 0)
    assert abs(b.ttft - (COST.overhead + 3 * COST.store_restore_s)) < 1e-9
    # the store's keys reached the router's index from A's node only (medium store)
    keys = prompt_block_keys(ROOT, b.tokens, BLOCK, limit=3)
    assert isinstance(router.index, TieredKvIndex)
    assert all(router.index.tiers[Medium.STORE].holders(k) == {nodes[a.node].address} for k in keys)
    # without the store, the other node recomputes the prompt
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 2, 5, COST, KvRouter(seed=0))
    assert reqs[0].node != reqs[1].node and (reqs[1].store_hits, reqs[1].uncached) == (0, 3 * TRACE_BLOCK_TOKENS)


def test_the_store_is_an_lru_shared_by_all_nodes(tmp_path: Path) -> None:
    # A store of 3 blocks: A's blocks go in, then B's push them out (LRU); C (A's prompt, on a node
    # whose pool lost A's blocks to B) finds them nowhere.
    turns = [(0, [1, 2, 3], 10), (100, [4, 5, 6], 10), (200, [1, 2, 3], 10)]
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 1, 5, COST, KvRouter(seed=0), store_blocks=3)
    assert (reqs[2].store_hits, reqs[2].uncached) == (0, 3 * TRACE_BLOCK_TOKENS)
    reqs = chat(tmp_path / "t.jsonl", turns)
    simulate(reqs, "kv-aware", 1, 5, COST, KvRouter(seed=0), store_blocks=6)
    assert (reqs[2].store_hits, reqs[2].uncached) == (3, 0)


def test_the_router_index_follows_every_tier_exactly(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    requests = load_trace(tmp_path / "t.jsonl", None)
    router = KvRouter(seed=0)
    nodes = simulate(requests, "kv-aware", 3, 40, CostModel(), router, host_blocks=30, store_blocks=90)
    index = router.index
    assert isinstance(index, TieredKvIndex)
    store = nodes[0].store
    assert store is not None and 0 < len(store.keys) <= 90
    for n in nodes:
        assert index.node_size(n.address) == len(n.blocks.hash_to_block)
        assert all(n.address in index.holders(k) for k in n.blocks.hash_to_block)
        assert 0 < len(n.host) <= 30
        assert index.tiers[Medium.HOST].node_size(n.address) == len(n.host)
        assert all(n.address in index.tiers[Medium.HOST].holders(k) for k in n.host)
        written = {k for k, w in store.keys.items() if w is n}
        assert index.tiers[Medium.STORE].node_size(n.address) == len(written)
        assert all(n.address in index.tiers[Medium.STORE].holders(k) for k in written)
        n.blocks.check_integrity()
    assert sum(r.host_hits for r in requests) > 0 and sum(r.store_hits for r in requests) > 0
    assert all(r.ttft > 0 for r in requests)


def test_tiers_off_gives_the_figures_of_the_code_before_the_tiers(tmp_path: Path) -> None:
    # Pinned from benchmarks/trace_sim.py at 7a3fcff (before the tiers) on this trace.
    write_trace(tmp_path / "t.jsonl")
    for routing, hits, ttft_sum in (("kv-aware", 176, 22.9605), ("wrr", 143, 24.5695)):
        requests = load_trace(tmp_path / "t.jsonl", None)
        simulate(requests, routing, 3, 40, CostModel(), KvRouter(seed=0))
        assert sum(r.hit_blocks for r in requests) == hits
        assert round(sum(r.ttft for r in requests), 6) == ttft_sum
        assert all(r.host_hits == r.store_hits == 0 for r in requests)


def test_cli_replays_with_tiers_off_and_on(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.trace_replay", "--trace", str(tmp_path / "t.jsonl"), "--nodes", "3"]
    cmd += ["--node-blocks", "40", "--host-blocks", "30", "--store-blocks", "90"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *lines, last = proc.stdout.strip().splitlines()
    assert lines and all("modelled" in line for line in lines)
    result = json.loads(last)
    for key in ("metric", "value", "baseline", "ratio", "target"):
        assert key in result
    assert "modelled" in result["metric"] and result["modelled"] is True
    off, on = result["tiers_off"], result["tiers_on"]
    assert off["host_hit"] == off["store_hit"] == 0 and off["total_hit"] == off["prefix_hit"]
    assert on["host_hit"] > 0 and on["store_hit"] > 0
    assert off["total_hit"] < on["total_hit"] <= on["bound"] == off["bound"]
    assert (result["value"], result["baseline"]) == (on["total_hit"], off["total_hit"])
    assert abs(on["total_hit"] - (on["prefix_hit"] + on["host_hit"] + on["store_hit"])) < 2e-4
    assert (result["node_blocks"], result["host_blocks"], result["store_blocks"]) == (40, 30, 90)
