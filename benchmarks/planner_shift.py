"""The runtime SLO planner on a workload that shifts (issue 51, item 3): prefill-heavy, then
decode-heavy, then prefill-heavy again, against the static shapes the planner moves between.

    python -m benchmarks.planner_shift [--quick] [--rounds 3] [--aiperf PATH] [--phase-s S]
        [--prefill-rate R] [--decode-rate R] [--statics 1p2d,2p1d]

Load: AIPerf replays one schedule on its own timestamps (`--fixed-schedule`, open loop): three
phases of `--phase-s` seconds each, Poisson arrivals within each: long prompts with short replies
(1,024 in, 16 out) at `--prefill-rate`, short prompts with long replies (64 in, 192 out) at
`--decode-rate`, then long prompts again. No prompt repeats (every request has ids of its own).

Targets, each a fresh `pdserve up` on the bench model with its defaults:
  * `planner`: `--planner slo` with the SLOs below, started in the default shape (1 prefill +
    2 decode), its budget those 3 nodes: it moves a node between roles as the load shifts;
  * `static:PpDd`, for each of `--statics`: the shapes it moves between, held fixed; `PpDd+slo`
    also tells that shape the SLOs, as the planner arm is told them (with `--tpot-slo` set the
    router's offload keeps decode nodes' streams within it, planner or not).

Measured per run: goodput over the run, the requests that met both SLOs (TTFT <= 5 s, TPOT <=
0.25 s: the goodput preset's) over the schedule's span (req/s); the attainment of each kind of
request; and for the planner its decisions (`pdserve_planner_decisions_total`, read from the router
before it stops). Targets alternate over `--rounds` (the order reversing each round), the same
schedule for every target within a round and a new one each round; medians are reported with every
round's figures. Target: the planner's goodput >= 1.2x the best static shape's.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from benchmarks.aiperf_client import INSTALL_HINT, find_aiperf
from benchmarks.common import add_rounds_arg, alternate, emit
from benchmarks.goodput_client import HUB_ID, Client, local_hub_cache, run, trace_args, warmup_args, write_trace
from benchmarks.goodput_load import ScaledTrace, parse_shapes
from benchmarks.goodput_slo import Outcome, Slo, failure_reasons, meets, outcome_of, profiling_records
from benchmarks.multiturn_servers import free_port, start_pdserve, stop

SERVED = "bench"
SLO = Slo(5.0, 0.25, 0.9)
TARGET_RATIO = 1.2
BLOCK = 64
"""Tokens one trace hash id stands for (AIPerf's `--prompt-input-tokens-block-size`)."""


@dataclass(frozen=True)
class Kind:
    """One kind of request the schedule sends."""

    name: str
    input_tokens: int
    output_tokens: int


PREFILL_HEAVY = Kind("prefill_heavy", 1024, 16)
DECODE_HEAVY = Kind("decode_heavy", 64, 192)


def schedule(phase_s: float, prefill_rate: float, decode_rate: float, seed: int) -> list[dict]:
    """Mooncake-format records: three phases of `phase_s` seconds (prefill-heavy, decode-heavy,
    prefill-heavy), Poisson arrivals in each; every request's hash ids its own (no shared prefix)."""
    if not phase_s > 0 or not prefill_rate > 0 or not decode_rate > 0:
        raise ValueError("--phase-s, --prefill-rate and --decode-rate must be > 0")
    rng = random.Random(seed)
    records: list[dict] = []
    next_id = 0
    phases = ((PREFILL_HEAVY, prefill_rate), (DECODE_HEAVY, decode_rate), (PREFILL_HEAVY, prefill_rate))
    for k, (kind, rate) in enumerate(phases):
        t = k * phase_s
        while (t := t + rng.expovariate(rate)) < (k + 1) * phase_s:
            ids = math.ceil(kind.input_tokens / BLOCK)
            records.append(
                {
                    "timestamp": round(t * 1000, 3),
                    "input_length": kind.input_tokens,
                    "output_length": kind.output_tokens,
                    "hash_ids": list(range(next_id, next_id + ids)),
                }
            )
            next_id += ids
    return records


def kind_of(record: dict) -> str:
    """Which kind an AIPerf record was sent as, by its prompt length (the two kinds differ 16x)."""
    entry = (record.get("metrics") or {}).get("input_sequence_length") or {}
    length = entry.get("value") if isinstance(entry, dict) else None
    if length is None:
        return "unknown"
    return (
        PREFILL_HEAVY.name
        if length > (PREFILL_HEAVY.input_tokens + DECODE_HEAVY.input_tokens) / 2
        else DECODE_HEAVY.name
    )


def score(records: list[dict], sent: dict[str, int], span_s: float) -> dict:
    """Goodput over the run (requests within both SLOs per second of the schedule) and each kind's
    attainment; a request with no record, or a failed one, is a miss."""
    outcomes: dict[str, list[Outcome]] = {name: [] for name in sent}
    for record in records:
        outcomes.setdefault(kind_of(record), []).append(outcome_of(record))
    met = {name: sum(meets(o, SLO) for o in got) for name, got in outcomes.items()}
    total = sum(sent.values())  # a failed record may not say its kind ("unknown"): it is one of these
    return {
        "goodput_req_s": round(sum(met.values()) / span_s, 4),
        "attainment": round(sum(met.values()) / total, 4) if total else 0.0,
        "by_kind": {
            name: {"sent": sent.get(name), "met": met[name], "failed": sum(not o.ok for o in got)}
            for name, got in outcomes.items()
        },
        "failure_reasons": failure_reasons(records),
    }


def planner_decisions(port: int) -> dict[str, float]:
    """`pdserve_planner_decisions_total` by action, from the router's /metrics (empty if unreadable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return decisions_in(resp.read().decode())
    except OSError:
        return {}


def decisions_in(text: str) -> dict[str, float]:
    """The decision counts by action in a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_planner_decisions_total{") and 'action="' in line:
            action = line.split('action="', 1)[1].split('"', 1)[0]
            out[action] = out.get(action, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def measure(up_args: list[str], args: argparse.Namespace, records: list[dict], label: str, planner: bool) -> dict:
    """Start one target, warm it, replay the schedule once, stop it."""
    span_s = records[-1]["timestamp"] / 1e3
    request_timeout = 1.5 * (SLO.ttft_s + SLO.tpot_s * (DECODE_HEAVY.output_tokens - 1)) + 5
    port = free_port()
    proc = start_pdserve(args.model, port, ["--served-model-name", SERVED, *up_args])
    try:
        client = Client(args.aiperf, f"http://127.0.0.1:{port}", SERVED, HUB_ID, request_timeout, None, args.hub_cache)
        for kind in (PREFILL_HEAVY, DECODE_HEAVY):  # every target warmed alike, before the clock starts
            run(client, warmup_args(2, kind.input_tokens, kind.output_tokens, args.seed), f"{label}/warm", 600)
        trace = ScaledTrace(records, BLOCK, 1.0, 0)
        path = write_trace(trace, args.tmp / f"{label.replace('/', '-')}.jsonl")
        t0 = time.monotonic()
        try:
            load = trace_args(path, trace, args.seed)
            got = profiling_records(run(client, load, label, span_s + request_timeout + 180))
            error = None
        except (RuntimeError, OSError) as e:  # every request a miss, and why
            got, error = [], str(e).strip().splitlines()[-1][:300] if str(e) else "failed"
        sent: dict[str, int] = {}
        for r in records:
            name = PREFILL_HEAVY.name if r["input_length"] == PREFILL_HEAVY.input_tokens else DECODE_HEAVY.name
            sent[name] = sent.get(name, 0) + 1
        result = {**score(got, sent, span_s), "wall_s": round(time.monotonic() - t0, 1)}
        if error:
            result["error"] = error
        if planner:
            result["decisions"] = planner_decisions(port)
        return result
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="phases of 120 s instead of 240 s")
    add_rounds_arg(p)
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default: the one on PATH)")
    p.add_argument("--phase-s", type=float, default=None, help="seconds per phase (default 240; --quick 120)")
    p.add_argument("--prefill-rate", type=float, default=0.5, help="req/s in the prefill-heavy phases")
    p.add_argument("--decode-rate", type=float, default=0.5, help="req/s in the decode-heavy phase")
    p.add_argument("--statics", default="1p2d,2p1d", help="the static shapes to compare (PpDd[+slo],...)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from pdserve.engine.builtin import default_model_dir

    args.model = str(default_model_dir("bench"))
    phase_s = args.phase_s or (120.0 if args.quick else 240.0)
    try:
        statics = parse_shapes(args.statics)
        schedule(phase_s, args.prefill_rate, args.decode_rate, 0)  # the flags, checked before anything starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    given, args.aiperf = args.aiperf, find_aiperf(args.aiperf)
    if args.aiperf is None:
        print(
            f"error: AIPerf not found ({given or 'PATH'}); install it in its own venv: {INSTALL_HINT}", file=sys.stderr
        )
        return 2
    slo_flags = ["--ttft-slo", f"{SLO.ttft_s:g}", "--tpot-slo", f"{SLO.tpot_s:g}"]
    with tempfile.TemporaryDirectory(prefix="planner-shift-") as tmp:
        args.tmp = Path(tmp)
        args.hub_cache = local_hub_cache(Path(args.model), args.tmp / "hf-cache")
        schedules = [schedule(phase_s, args.prefill_rate, args.decode_rate, args.seed + r) for r in range(args.rounds)]
        calls: dict[str, int] = {}

        def arm(name: str, up_args: list[str], planner: bool) -> dict:
            r = calls[name] = calls.get(name, -1) + 1  # an arm's r-th run is round r's: that round's schedule
            return measure(up_args, args, schedules[r], f"{name}/round{r}", planner)

        arms: dict[str, Callable[[], dict]] = {}
        arms["planner"] = partial(arm, "planner", ["--planner", "slo", *slo_flags], True)
        for s in statics:
            arms[f"static:{s.name}"] = partial(arm, f"static:{s.name}", s.up_args(SLO), False)
        ran = alternate(arms, args.rounds)
    rounds = {name: ran.of(name) for name in arms}
    med = {name: round(statistics.median(r["goodput_req_s"] for r in per), 4) for name, per in rounds.items()}
    best = max((n for n in med if n != "planner"), key=lambda n: med[n])
    ratio = round(med["planner"] / med[best], 3) if med[best] else None
    emit(
        {
            "metric": "planner_goodput_req_s",
            "value": med["planner"],
            "baseline": med[best],
            "baseline_shape": best,
            "ratio": ratio,
            "target": TARGET_RATIO,
            "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
            "workload": {
                "phase_s": phase_s,
                "phases": ["prefill_heavy", "decode_heavy", "prefill_heavy"],
                "prefill_heavy": [PREFILL_HEAVY.input_tokens, PREFILL_HEAVY.output_tokens, args.prefill_rate],
                "decode_heavy": [DECODE_HEAVY.input_tokens, DECODE_HEAVY.output_tokens, args.decode_rate],
            },
            "goodput_by_target": med,
            "rounds": rounds,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
