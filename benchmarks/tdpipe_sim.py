"""TD-Pipe simulation report: TD-Pipe vs PP+SB vs PP+HB and the ablations.

Runs the discrete-event simulator on the published L20 cost table (TD-Pipe authors'
profile of Llama-13B on one L20; 4 pipeline stages) with a synthetic ShareGPT-like
workload (inputs <= 1023 tokens; no dataset can be downloaded here, see
tdpipe/workload.py for the parameters). The metric is TD-Pipe's output-token
throughput; the baseline is PP+SB in the same run; the paper's target is 2.73x.

    python -m benchmarks.tdpipe_sim [--quick] [--plot kv.png]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import emit
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.simulator import POLICIES, plot_kv_usage, simulate
from pdserve.tdpipe.workload import WorkloadConfig, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 requests instead of 5,000")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument(
        "--table",
        default="L20-Llama-13B",
        help="cost table name (L20-Llama-13B must be downloaded first: see tdpipe/data/README.md) or 'analytic'",
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--plot", default=None, help="write a KV-usage PNG (paper Fig. 12 style)")
    args = parser.parse_args()
    num = args.requests or (1000 if args.quick else 5000)
    table = CostTable.builtin(args.table)
    inst = InstanceConfig(num_stages=args.stages)
    requests = generate(WorkloadConfig(num_requests=num))
    results = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        results[policy] = simulate(policy, table, inst, requests)
        print(f"{policy:22s} {results[policy].summary()} ({time.perf_counter() - t0:.1f}s)", flush=True)
    if args.plot:
        plot_kv_usage([results["td-pipe"], results["pp+sb"], results["pp+hb"]], args.plot)
    tput = {p: round(s.throughput, 1) for p, s in results.items()}
    td, sb = tput["td-pipe"], tput["pp+sb"]
    emit(
        {
            "metric": "tdpipe_sim_output_tokens_per_s",
            "value": td,
            "baseline": sb,
            "ratio": round(td / sb, 3),
            "target": 2.73,
            "unit": "output tok/s (simulated)",
            "requests": num,
            "stages": args.stages,
            "table": args.table,
            "throughput": tput,
            "td_over_pp_hb": round(td / tput["pp+hb"], 3),
            "work_stealing_gain": round(td / tput["td-pipe-no-stealing"], 3),
            "greedy_over_kv_threshold": round(td / tput["td-pipe-kv-threshold"], 3),
            "intensity_over_completion_ratio": round(td / tput["td-pipe-completion"], 3),
            "phase_switches": {p: len(s.phase_switches) for p, s in results.items()},
            "bubble_frac": {p: s.summary()["bubble_frac"] for p, s in results.items()},
            "preemptions": {p: s.num_preemptions for p, s in results.items()},
        }
    )


if __name__ == "__main__":
    main()
