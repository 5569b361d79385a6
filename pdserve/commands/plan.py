"""`pdserve plan`: the prefill/decode shape for a workload, SLOs and budget, by simulation (DistServe's
placement search). The library is `pdserve/planner/`; this module parses flags and refuses bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from pdserve.commands.config_flags import config_flag, plain_flag

if TYPE_CHECKING:  # the planner is imported when the command runs, not when `pdserve --help` builds
    from pdserve.planner.config import SLO, SimConfig
    from pdserve.planner.profile import Profile
    from pdserve.planner.search import Budget
    from pdserve.planner.workload import Workload


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.planner.config import SLO, SimConfig

    p = subparsers.add_parser(
        "plan", help="recommend how many prefill and decode nodes (and their degree) by simulating goodput"
    )
    src = p.add_argument_group("profile: forward-pass time by tokens (one of the two)")
    src.add_argument(
        "--profile",
        help="a TD-Pipe latency table (`Total Length,Execute Time` CSV: a path, or a name such as "
        "L20-Llama-13B looked up like `pdserve simulate --table`; it names <hardware>-<model>, per GPU), "
        "or a JSON profile written by --measure",
    )
    src.add_argument(
        "--measure",
        metavar="PATH",
        help="measure --model on this machine's cores at each thread count the search uses (powers of two "
        "up to --cores), write the profile to PATH (JSON, for later --profile runs) and plan with it",
    )
    p.add_argument(
        "--model",
        help="the model to plan for: a profile for another model is refused; with --measure, the checkpoint "
        "directory to time (default: the built-in tiny model)",
    )
    slo = p.add_argument_group("SLOs")
    slo.add_argument("--ttft-slo", type=float, required=True, help="time to first token target, seconds")
    slo.add_argument("--tpot-slo", type=float, required=True, help="time per output token target, seconds")
    config_flag(slo, SLO, "attainment", keep_default=True)
    load = p.add_argument_group("workload: a trace, or mean lengths")
    load.add_argument(
        "--trace", help="a .jsonl trace (timestamp ms, input_length, output_length), e.g. ../shared/traces/*.jsonl"
    )
    plain_flag(
        load,
        "--arrival",
        choices=("poisson", "trace"),
        default="poisson",
        help="arrivals at each rate searched: Poisson, or the trace's own timestamps scaled to the rate",
    )
    load.add_argument(
        "--input-len",
        type=int,
        help="mean prompt length in tokens as the server counts them, chat template included "
        "(usage.prompt_tokens; without --trace)",
    )
    load.add_argument("--output-len", type=int, help="mean output length in tokens (without --trace)")
    plain_flag(load, "--len-spread", type=float, default=0.5, help="lengths uniform in mean x [1 - s, 1 + s]")
    plain_flag(load, "--num-requests", type=int, default=200, help="requests simulated (the first of a trace)")
    plain_flag(load, "--seed", type=int, default=0, help="seed of the lengths and the Poisson arrivals")
    budget = p.add_argument_group("budget: CPU cores, or GPUs")
    budget.add_argument("--cores", type=int, help="cores to share between the nodes (a profile measured on cores)")
    plain_flag(budget, "--gpus-per-node", type=int, default=8, help="GPUs per node: the largest TP degree")
    plain_flag(budget, "--nodes", type=int, default=1, help="nodes of --gpus-per-node GPUs")
    sim = p.add_argument_group("simulated cluster")
    for f in dataclasses.fields(SimConfig):  # each field a flag of the same name
        config_flag(sim, SimConfig, f.name, keep_default=True)
    plain_flag(p, "--top", type=int, default=5, help="shapes shown in the table")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (every shape searched)")
    p.set_defaults(func=lambda args: run(args, p))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.planner.report import UNIT_NAMES, closest_text, plan_json, plan_text
    from pdserve.planner.search import closest, plan, shapes

    try:
        slo, config = _slo(args), _sim_config(args)
        workload, described = _workload(args)
        profile, budget = _profile_and_budget(args, workload, config)
    except ValueError as e:
        parser.error(str(e))
    print(f"simulating {len(shapes(budget))} shapes...", file=sys.stderr)  # tens of seconds for 8 GPUs
    ranked = plan(profile, workload, slo, budget, config)
    unit = profile.unit
    if ranked[0].goodput.rate <= 0:
        parser.error(
            f"--ttft-slo {args.ttft_slo:g} / --tpot-slo {args.tpot_slo:g}: no shape within the budget meets them "
            f"for --attainment {args.attainment:g} of requests; {closest_text(closest(ranked), unit)}"
        )
    if args.json:
        json.dump(plan_json(ranked, profile, slo, budget.units, described), sys.stdout, indent=1)
        print()
        return 0
    degrees, name = ", ".join(map(str, sorted(profile.tables))), UNIT_NAMES[unit]
    print(f"profile: {profile.model} on {profile.hardware}, per {name}; profiled degrees {degrees}", end="")
    print(f", others modelled (Amdahl, parallel fraction {config.parallel_fraction:g})")
    if config.host_cpu_ms_per_request:
        print(f"other processes on the cores: {config.host_cpu_ms_per_request:g} CPU ms per request (modelled)")
    print("workload: " + ", ".join(f"{k} {v}" for k, v in described.items()))
    print(f"SLOs: TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s for {slo.attainment:.0%} of requests; ", end="")
    print(f"budget {budget.units} {name}s\n")
    print("\n".join(plan_text(ranked, profile, args.top)))
    return 0


def _slo(args: argparse.Namespace) -> SLO:
    from pdserve.planner.config import SLO

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    return SLO(args.ttft_slo, args.tpot_slo, args.attainment)  # ValueError naming the flag


def _sim_config(args: argparse.Namespace) -> SimConfig:
    from pdserve.planner.config import SimConfig

    try:
        return SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    except ValueError as e:
        raise ValueError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None


def _workload(args: argparse.Namespace) -> tuple[Workload, dict]:
    """The workload, and a description of it (a dict, printed or put in the JSON)."""
    from pdserve.planner.workload import from_lengths, from_trace

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.trace:
        try:
            workload = from_trace(args.trace, args.num_requests, args.arrival, args.seed)
        except (OSError, ValueError) as e:
            raise ValueError(f"--trace: {e}") from None
        source = {"trace": args.trace}
    else:
        if args.input_len is None or args.output_len is None:
            raise ValueError("--input-len and --output-len (or --trace) are required")
        if args.arrival == "trace":
            raise ValueError("--arrival trace needs --trace")
        for flag, value in (("--input-len", args.input_len), ("--output-len", args.output_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 <= args.len_spread < 1:
            raise ValueError(f"--len-spread must be in [0, 1), got {args.len_spread:g}")
        workload = from_lengths(args.input_len, args.output_len, args.len_spread, args.num_requests, args.seed)
        source = {"input_len": args.input_len, "output_len": args.output_len, "len_spread": args.len_spread}
    return workload, {
        **source,
        "requests": len(workload.requests),
        "mean_input": round(workload.mean_input, 1),
        "mean_output": round(workload.mean_output, 1),
        "arrival": args.arrival,
        "seed": args.seed,
    }


def _profile_and_budget(args: argparse.Namespace, workload: Workload, config: SimConfig) -> tuple[Profile, Budget]:
    """The profile (loaded, or measured now) and the budget its unit calls for; every mismatch names its flag."""
    from pdserve.planner.profile import load_profile
    from pdserve.planner.search import Budget, powers_of_two

    if bool(args.profile) == bool(args.measure):
        raise ValueError("give one of --profile and --measure")
    if args.measure and args.cores is None:
        raise ValueError("--cores is required with --measure: the cores to plan for")
    if args.cores is not None and args.cores < 2:
        raise ValueError(f"--cores {args.cores}: the budget cannot hold one prefill and one decode node")
    if args.measure:
        profile = _measure(args, workload, config, powers_of_two(args.cores))
    else:
        try:
            profile = load_profile(args.profile)
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile: {e}") from None
    try:
        profile.check_model(args.model)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from None
    if profile.unit == "core":
        if args.cores is None:
            raise ValueError(f"--cores: the profile was measured on CPU cores ({profile.model}): give the cores")
        degrees = sorted(set(powers_of_two(args.cores)) | {d for d in profile.tables if d <= args.cores})
        return profile, Budget(args.cores, 1, tuple(degrees))
    if args.cores is not None:
        raise ValueError(f"--cores: the profile is per GPU ({profile.hardware}); give --gpus-per-node and --nodes")
    if config.host_cpu_ms_per_request:
        raise ValueError(
            f"--host-cpu-ms-per-request: the profile is per GPU ({profile.hardware}); the host's CPU does not "
            "share a GPU's time (for a profile measured on cores only)"
        )
    if args.gpus_per_node < 1 or args.nodes < 1:
        raise ValueError(f"--gpus-per-node and --nodes must be >= 1, got {args.gpus_per_node}, {args.nodes}")
    units = args.gpus_per_node * args.nodes
    if units < 2:
        raise ValueError(
            f"--gpus-per-node {args.gpus_per_node} x --nodes {args.nodes}: {units} GPU cannot hold "
            "one prefill and one decode node"
        )
    return profile, Budget(args.gpus_per_node, args.nodes, powers_of_two(args.gpus_per_node))


def _measure(args: argparse.Namespace, workload: Workload, config: SimConfig, threads: tuple[int, ...]) -> Profile:
    from pathlib import Path

    from pdserve.planner.measure import measure_profile

    model = args.model
    if model is None:
        from pdserve.engine.builtin import default_model_dir

        model = str(default_model_dir("tiny"))
    if not Path(model, "config.json").is_file():
        raise ValueError(f"--model: {model} is not a checkpoint directory (no config.json) to measure")
    args.model = model  # the profile is named after it: the model check below passes by construction
    print(f"measuring {model} at {', '.join(map(str, threads))} thread(s)...", file=sys.stderr)
    profile = measure_profile(model, list(threads), workload, config)
    Path(args.measure).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    print(f"wrote {args.measure}", file=sys.stderr)
    return profile
