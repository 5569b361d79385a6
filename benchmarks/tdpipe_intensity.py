"""TD-Pipe decode→prefill switch: why the intensity rule lost to a fixed completion ratio.

Runs the TD-Pipe simulator (same workload and instance as benchmarks/tdpipe_sim.py)
with the spatial-temporal intensity switch in several variants, each isolating one
suspected cause, and with fixed completion ratios 0.1–0.9, on every published L20
table found (see tdpipe/data/README.md; set $PDSERVE_TDPIPE_TABLES=../shared/tdpipe
when the checkout does not sit beside ../shared). Every intensity decision is
recorded, so the table shows where the policy switched, not only how fast it ran.

    PDSERVE_TDPIPE_TABLES=../shared/tdpipe python -m benchmarks.tdpipe_intensity [--quick]

Variants (TDPipeOptions fields, or a wrapper of `_should_prefill` here):
  before       spatial peak at ref_batch_size 256 (the paper's rule as we had it)
  after        spatial peak at the decode phase's starting batch, capped at 256 (the fix)
  no-refill    `before` without our refill term in the temporal bubble
  after-no-refill  `after` without it
  remaining    `before`, spatial at the returned batch's own size, not the stealer average
  per-round    `before`, decided once per round of num_stages batch returns (as the
               authors' code does), not at every return
  ref-128      `before` with ref_batch_size 128
  completion-x fixed completion ratio x (the ablation baseline of the paper's Fig. 16)

The metric is the intensity switch's throughput on L20-Llama-13B after the fix; the
baseline is the best fixed completion ratio in the same run; the target is 1.0 (the
paper: the intensity switch is never worse than any fixed ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import pdserve.tdpipe.td_scheduler as td_scheduler
from benchmarks.common import emit
from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.intensity import IntensityDecision
from pdserve.tdpipe.td_scheduler import TDPipeScheduler
from pdserve.tdpipe.workload import SimRequest, WorkloadConfig, generate

TABLES = ("L20-Llama-13B", "L20-Qwen2.5-32B", "L20-opt-125m")
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class TracingTable(CostTable):
    """A cost table that counts the forward passes the pipeline runs, by phase.

    The simulated pipeline prices each batch with `stage_ms`; the controller's own
    estimates (inside `_should_prefill`) are not passes and are not counted.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "passes", [])  # (phase, tokens) per pass
        object.__setattr__(self, "phase", lambda: "?")
        object.__setattr__(self, "muted", False)

    def stage_ms(self, num_tokens: int, num_stages: int) -> float:
        if not self.muted:
            self.passes.append((self.phase(), num_tokens))
        return super().stage_ms(num_tokens, num_stages)


@dataclass
class Probe:
    """What one run decided: every intensity check, and the state at each switch."""

    checks: int = 0
    switches: list[dict[str, float]] = field(default_factory=list)


class _RemainingStealer:
    """Stands in for the WorkStealer so `_should_prefill` sees the returned batch's own size."""

    def __init__(self, stealer: Any) -> None:
        self._s = stealer

    def average(self, num_remaining: int) -> int:
        return num_remaining

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)


class ProbedScheduler(TDPipeScheduler):
    """TDPipeScheduler with its decode→prefill decisions recorded (and the two
    experiment-only variants: `remaining` batch size, `per_round` checks)."""

    def __init__(
        self,
        table: TracingTable,
        inst: InstanceConfig,
        opts: TDPipeOptions,
        name: str,
        remaining: bool = False,
        per_round: bool = False,
    ) -> None:
        super().__init__(table, inst, opts, name)
        self.probe = Probe()
        self.remaining, self.per_round = remaining, per_round
        self._round: tuple[int, int] = (-1, -1)
        self.last: IntensityDecision | None = None
        object.__setattr__(table, "phase", lambda: self.stats.phase_switches[-1][1])

    def _should_prefill(
        self,
        stealer: Any,
        remaining: list[SimRequest],
        waiting: Any,  # type: ignore[override]
        done_ratio: float,
        memory: Any,
        step: int,
    ) -> bool:
        if self.per_round:
            if self._round == (id(stealer), step):
                return False
            self._round = (id(stealer), step)
        self.last = None
        object.__setattr__(self.table, "muted", True)
        try:
            switch = super()._should_prefill(
                _RemainingStealer(stealer) if self.remaining else stealer, remaining, waiting, done_ratio, memory, step
            )
        finally:
            object.__setattr__(self.table, "muted", False)
        self.probe.checks += 1
        if switch:
            row = {"done": done_ratio, "batch": float(len(remaining)), "kv": self.kv.usage}
            if self.last is not None:
                row.update(spatial=self.last.spatial, temporal=self.last.temporal)
            self.probe.switches.append(row)
        return switch


@contextlib.contextmanager
def _recording(sched_ref: list[ProbedScheduler]) -> Iterator[None]:
    """Let the running ProbedScheduler see the IntensityDecision behind its last answer."""
    original = td_scheduler.decide

    def recorded(*args: Any, **kwargs: Any) -> IntensityDecision:
        d = original(*args, **kwargs)
        sched_ref[0].last = d
        return d

    td_scheduler.decide = recorded  # type: ignore[assignment]
    try:
        yield
    finally:
        td_scheduler.decide = original  # type: ignore[assignment]


def variants(quick: bool) -> dict[str, tuple[TDPipeOptions, dict[str, bool]]]:
    v: dict[str, tuple[TDPipeOptions, dict[str, bool]]] = {
        "before": (TDPipeOptions(spatial_peak="fixed"), {}),
        "after": (TDPipeOptions(), {}),
    }
    if not quick:
        v.update(
            {
                "no-refill": (TDPipeOptions(spatial_peak="fixed", temporal_refill=False), {}),
                "after-no-refill": (TDPipeOptions(temporal_refill=False), {}),
                "remaining": (TDPipeOptions(spatial_peak="fixed"), {"remaining": True}),
                "per-round": (TDPipeOptions(spatial_peak="fixed"), {"per_round": True}),
                "ref-128": (TDPipeOptions(spatial_peak="fixed", ref_batch_size=128), {}),
            }
        )
    for r in (0.3, 0.5) if quick else RATIOS:
        v[f"completion-{r}"] = (TDPipeOptions(decode_switch="completion", completion_threshold=r), {})
    return v


def run_one(
    table: CostTable,
    inst: InstanceConfig,
    requests: list[SimRequest],
    name: str,
    opts: TDPipeOptions,
    extra: dict[str, bool],
) -> dict[str, Any]:
    traced = TracingTable(table.name, table.tokens, table.times_ms)
    sched = ProbedScheduler(traced, inst, opts, name, **extra)
    t0 = time.perf_counter()
    with _recording([sched]):
        stats = sched.run(copy.deepcopy(requests))
    assert stats.output_tokens == sum(r.output_len for r in requests), name
    decode = [n for phase, n in traced.passes if phase == "decode"]
    sw = sched.probe.switches

    def med(key: str) -> float | None:
        vals = [s[key] for s in sw if key in s]
        return round(statistics.median(vals), 3) if vals else None

    s = stats.summary()
    return {
        "variant": name,
        "tok_s": s["throughput_tok_s"],
        "cycles": sum(1 for _, p in stats.phase_switches if p == "decode"),
        "bubble": s["bubble_frac"],
        "preempt": stats.num_preemptions,
        "decode_batch": round(sum(decode) / max(1, len(decode)), 1),
        "decode_ms_tok": round(sum(table.forward_ms(n) for n in decode) / max(1, sum(decode)), 3),
        "sw_done": med("done"),
        "sw_batch": med("batch"),
        "sw_kv": med("kv"),
        "sw_spatial": med("spatial"),
        "sw_temporal": med("temporal"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


COLUMNS = (
    "variant",
    "tok_s",
    "x_best_ratio",
    "cycles",
    "bubble",
    "preempt",
    "decode_batch",
    "decode_ms_tok",
    "sw_done",
    "sw_batch",
    "sw_kv",
    "sw_spatial",
    "sw_temporal",
    "wall_s",
)


def print_table(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n### {name}\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in COLUMNS) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="L20-Llama-13B only, 1,200 requests, before/after and ratios 0.3/0.5 (< 1 min)",
    )
    parser.add_argument("--requests", type=int, default=None, help="default 5,000 (1,200 with --quick)")
    parser.add_argument(
        "--tables",
        nargs="+",
        default=None,
        help=f"cost tables (default: {' '.join(TABLES)}; with --quick the first only)",
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="run only these intensity variants (the completion ratios always run)",
    )
    args = parser.parse_args()
    num = args.requests or (1200 if args.quick else 5000)
    names = args.tables or (TABLES[:1] if args.quick else TABLES)
    inst = InstanceConfig(num_stages=args.stages)
    requests = generate(WorkloadConfig(num_requests=num))
    print(f"{num} requests, {args.stages} stages, {inst.capacity_blocks} KV blocks of {inst.block_size} tokens")
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        table = CostTable.builtin(name)
        chosen = {
            v: o
            for v, o in variants(args.quick).items()
            if args.variants is None or v in args.variants or v.startswith("completion-") or v in ("before", "after")
        }
        rows = [run_one(table, inst, requests, v, opts, extra) for v, (opts, extra) in chosen.items()]
        best = max((r for r in rows if r["variant"].startswith("completion-")), key=lambda r: r["tok_s"])
        for r in rows:
            r["x_best_ratio"] = round(r["tok_s"] / best["tok_s"], 3)
        print_table(name, rows)
        by = {r["variant"]: r for r in rows}
        summary[name] = {
            "before": by["before"]["tok_s"],
            "after": by["after"]["tok_s"],
            "best_ratio": best["tok_s"],
            "best_ratio_at": float(best["variant"].split("-")[1]),
            "completion_0.5": by["completion-0.5"]["tok_s"],
            "before_x_best": by["before"]["x_best_ratio"],
            "after_x_best": by["after"]["x_best_ratio"],
            "cycles_before": by["before"]["cycles"],
            "cycles_after": by["after"]["cycles"],
        }
    head = summary[names[0]]
    emit(
        {
            "metric": "tdpipe_intensity_switch_tok_s",
            "value": head["after"],
            "baseline": head["best_ratio"],
            "ratio": round(head["after"] / head["best_ratio"], 3),
            "target": 1.0,
            "unit": "output tok/s (simulated), intensity switch after the fix vs best fixed completion ratio",
            "table": names[0],
            "requests": num,
            "stages": args.stages,
            "per_table": summary,
        }
    )


if __name__ == "__main__":
    main()
