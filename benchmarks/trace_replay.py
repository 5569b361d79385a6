"""Replay Mooncake's conversation trace through the router's KV-aware routing vs WRR (issue 22).

    python -m benchmarks.trace_replay [--quick] [--trace PATH] [--nodes 4] [--node-blocks 8000]

Each trace block id becomes a fixed run of 16 token ids (equal ids, equal tokens), and each
prompt gets one token of its own (the new message), so a prompt can hit all of its blocks. The
simulated nodes and the cost model are in benchmarks/trace_sim.py; the routing, the KV index and
the event consumer are the router's own code. Both policies replay the same requests in the same
run. Reported:
- prefix_hit: prompt blocks served from the node's prefix cache / all prompt blocks (each trace
  block is 512 tokens, so this is the share of prompt tokens up to the partial last blocks);
- bound: the same with one infinite shared cache (a block hits if any earlier prompt had it);
- TTFT p50/p99 of the cost model; max_over_mean: the busiest node's prefill work over the mean.
Targets: prefix_hit >= 0.30, TTFT p50 <= 0.6 x wrr, max_over_mean <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import emit, pct
from benchmarks.trace_sim import BLOCK, CostModel, SimRequest, simulate
from pdserve.router.kv_policy import PolicyParams
from pdserve.router.kv_routing import KvRouter

ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "mooncake_conversation_trace.jsonl"
QUICK_REQUESTS = 4000


def default_trace() -> Path:
    """../shared/traces/ from the project root (a worktree's checkout may sit one level deeper)."""
    candidates = [ROOT.parent / "shared" / "traces" / TRACE_NAME, ROOT.parents[1] / "shared" / "traces" / TRACE_NAME]
    return next((p for p in candidates if p.exists()), candidates[0])


def load_trace(path: Path, limit: int | None) -> list[SimRequest]:
    requests: list[SimRequest] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            rec = json.loads(line)
            tokens = [h * BLOCK + j for h in rec["hash_ids"] for j in range(BLOCK)]
            tokens.append(2**31 + len(requests))  # the prompt's own last token (never part of a cached block)
            requests.append(
                SimRequest(
                    len(requests),
                    rec["timestamp"] / 1000.0,
                    rec["input_length"],
                    rec["output_length"],
                    tokens,
                    len(rec["hash_ids"]),
                )
            )
    return requests


def infinite_cache_bound(requests: list[SimRequest]) -> float:
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        blocks = [tuple(r.tokens[i * BLOCK : (i + 1) * BLOCK]) for i in range(r.blocks)]
        run = 0
        while run < len(blocks) and blocks[run] in seen:
            run += 1
        hit, total = hit + run, total + len(blocks)
        seen.update(blocks)
    return hit / total


def run(requests: list[SimRequest], routing: str, args: argparse.Namespace, params: PolicyParams) -> dict:
    for r in requests:  # fresh per-run state
        r.node, r.hit_blocks, r.uncached, r.ttft, r.block_ids = -1, 0, 0, 0.0, []
    router = KvRouter(params=params, seed=0)
    cost = CostModel(prefill_tok_s=args.prefill_tok_s, tpot=args.tpot)
    start = time.perf_counter()
    nodes = simulate(requests, routing, args.nodes, args.node_blocks, cost, router)
    ttfts = [r.ttft for r in requests]
    work = [n.busy_time for n in nodes]
    counts = [n.requests for n in nodes]
    return {
        "prefix_hit": sum(r.hit_blocks for r in requests) / sum(r.blocks for r in requests),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "max_over_mean": max(work) / (sum(work) / len(work)),
        "max_over_mean_requests": max(counts) / (sum(counts) / len(counts)),
        "decisions": {f"{role}/{reason}": n for (role, reason), n in sorted(router.decisions.items())},
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests only")
    parser.add_argument("--trace", type=Path, default=None, help=f"default ../shared/traces/{TRACE_NAME}")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--node-blocks", type=int, default=8000, help="KV blocks per node, in trace blocks")
    parser.add_argument("--prefill-tok-s", type=float, default=CostModel.prefill_tok_s)
    parser.add_argument("--tpot", type=float, default=CostModel.tpot, help="seconds per output token")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    defaults = PolicyParams()
    for name in ("miss_weight", "load_weight", "queue_weight", "balance_eps", "explore"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=float, default=getattr(defaults, name), help="policy parameter (kv_policy.py)")
    args = parser.parse_args()
    trace = args.trace or default_trace()
    if not trace.exists():
        raise SystemExit(f"error: trace {trace} not found (see --trace)")
    requests = load_trace(trace, args.requests or (QUICK_REQUESTS if args.quick else None))
    params = PolicyParams(
        miss_weight=args.miss_weight,
        load_weight=args.load_weight,
        queue_weight=args.queue_weight,
        balance_eps=args.balance_eps,
        explore=args.explore,
    )
    bound = infinite_cache_bound(requests)
    kv = run(requests, "kv-aware", args, params)
    wrr = run(requests, "wrr", args, params)
    for name, res in (("kv-aware", kv), ("wrr", wrr)):
        print(f"{name}: {json.dumps(res)}", flush=True)
    ratio = kv["ttft_p50"] / wrr["ttft_p50"]
    emit(
        {
            "metric": "modelled TTFT p50 (s), kv-aware",
            "value": round(kv["ttft_p50"], 4),
            "baseline": round(wrr["ttft_p50"], 4),
            "ratio": round(ratio, 3),
            "target": "prefix_hit >= 0.30, ratio <= 0.6, max_over_mean <= 1.3",
            "prefix_hit": round(kv["prefix_hit"], 4),
            "wrr_prefix_hit": round(wrr["prefix_hit"], 4),
            "bound": round(bound, 4),
            "max_over_mean": round(kv["max_over_mean"], 3),
            "ttft_p99": round(kv["ttft_p99"], 4),
            "wrr_ttft_p99": round(wrr["ttft_p99"], 4),
            "requests": len(requests),
            "nodes": args.nodes,
            "node_blocks": args.node_blocks,
            "met": kv["prefix_hit"] >= 0.30 and ratio <= 0.6 and kv["max_over_mean"] <= 1.3,
        }
    )


if __name__ == "__main__":
    main()
