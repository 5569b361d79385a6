"""`pdserve simulate`: run the TD-Pipe simulator and the PP baselines on a cost table."""

from __future__ import annotations

import argparse
import bisect
import sys
from pathlib import Path

from pdserve.commands.config_flags import config_flag, plain_flag


DEFAULT_POLICIES = ("td-pipe", "pp+sb", "pp+hb")
DEFAULT_REQUESTS = 1000
"""A quick run (WorkloadConfig's own default, 5000, is the paper's job size)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.tdpipe.config import InstanceConfig
    from pdserve.tdpipe.workload import WorkloadConfig

    p = subparsers.add_parser("simulate", help="simulate TD-Pipe vs pipeline-parallel baselines")
    p.add_argument(
        "--policy",
        action="append",
        help=f"policy to run (repeatable; default: {', '.join(DEFAULT_POLICIES)}; 'all' for every one)",
    )
    plain_flag(
        p,
        "--table",
        default="auto",
        help="cost table: a CSV path, a name in tdpipe/data/ (e.g. L20-Llama-13B once downloaded, "
        "cpu-tiny), 'analytic' (GPU-like built-in) or 'auto' (L20-Llama-13B if present, else analytic)",
    )
    plain_flag(p, "--requests", type=int, default=DEFAULT_REQUESTS, help="synthetic ShareGPT-like requests")
    config_flag(p, WorkloadConfig, "seed", keep_default=True)
    config_flag(p, InstanceConfig, "num_stages", "--stages", dest="stages", keep_default=True)
    config_flag(p, InstanceConfig, "capacity_blocks", keep_default=True)
    config_flag(p, InstanceConfig, "block_size", keep_default=True)
    plain_flag(p, "--timeline-points", type=int, default=10, help="KV-usage samples to print")
    p.add_argument("--plot", default=None, help="write a PNG of KV usage over time (paper Fig. 12 style)")
    p.set_defaults(func=run)


def _usage_at(samples: list[tuple[float, float]], t: float) -> float:
    i = bisect.bisect_right([s for s, _ in samples], t) - 1
    return samples[max(i, 0)][1] if samples else 0.0


def run(args: argparse.Namespace) -> int:
    from pdserve.tdpipe.config import InstanceConfig
    from pdserve.tdpipe.cost_table import CostTable
    from pdserve.tdpipe.simulator import POLICIES, plot_kv_usage, simulate
    from pdserve.tdpipe.workload import WorkloadConfig, generate

    policies = args.policy or list(DEFAULT_POLICIES)
    if "all" in policies:
        policies = list(POLICIES)
    try:
        table = CostTable.from_csv(args.table) if Path(args.table).is_file() else CostTable.builtin(args.table)
        inst = InstanceConfig(num_stages=args.stages, capacity_blocks=args.capacity_blocks, block_size=args.block_size)
        requests = generate(WorkloadConfig(num_requests=args.requests, seed=args.seed))
        results = [simulate(p, table, inst, requests) for p in policies]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"table {table.name}, {args.stages} stages, {args.requests} requests, "
        f"{args.capacity_blocks} KV blocks of {args.block_size} tokens"
    )
    for s in results:
        summary = s.summary()
        print(
            f"\n{s.name}: {summary['throughput_tok_s']} output tok/s, makespan {summary['makespan_s']} s, "
            f"bubble {s.bubble_ms / 1000:.1f} stage-s ({summary['bubble_frac']:.1%}), "
            f"{summary['phase_switches']} phase switches, {s.num_preemptions} preemptions"
        )
        samples = sorted(s.kv_samples)
        n = max(1, args.timeline_points)
        points = [s.makespan_ms * (i + 1) / n for i in range(n)]
        print("  KV usage: " + " ".join(f"{t / 1000:.0f}s:{_usage_at(samples, t):.0%}" for t in points))
    if len(results) > 1:
        base = results[0].throughput
        print(
            "\nthroughput relative to "
            + results[0].name
            + ": "
            + ", ".join(f"{s.name} {s.throughput / base:.2f}x" for s in results)
        )
    if args.plot:
        plot_kv_usage(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
