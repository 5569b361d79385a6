"""A plan as text (the recommendation, then the runner-up shapes in a table) or as JSON."""

from __future__ import annotations

from dataclasses import asdict

from pdserve.planner.config import SLO
from pdserve.planner.profile import Profile
from pdserve.planner.search import Ranked

UNIT_NAMES = {"gpu": "GPU", "core": "core"}


def rate(value: float) -> str:
    """A rate in requests/s with three significant figures, never in exponent form."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def shape_json(r: Ranked, unit: str) -> dict:
    return {
        "shape": r.shape.label(unit),
        **asdict(r.shape),
        "units": r.shape.units,
        "goodput_rps": round(r.goodput.rate, 4),
        "goodput_per_unit_rps": round(r.per_unit, 4),
        "attainment": round(r.goodput.attainment, 4),
        "lowest_rate_searched_rps": round(r.goodput.floor_rate, 6),
        "bounded": r.goodput.bounded,
        "tables": "profiled" if r.profiled else "modelled",
    }


def plan_json(ranked: list[Ranked], profile: Profile, slo: SLO, budget_units: int, workload: dict) -> dict:
    best = ranked[0] if ranked and ranked[0].goodput.rate > 0 else None
    return {
        "modelled": True,
        "profile": {"model": profile.model, "hardware": profile.hardware, "unit": profile.unit},
        "profiled_degrees": sorted(profile.tables),
        "slo": asdict(slo),
        "budget_units": budget_units,
        "workload": workload,
        "recommended": shape_json(best, profile.unit) if best else None,
        "shapes": [shape_json(r, profile.unit) for r in ranked],
    }


def up_command(r: Ranked) -> str | None:
    """The `pdserve up` line of a shape on cores, when one `--num-threads` fits every node."""
    s = r.shape
    if not s.colocated and s.prefill_degree != s.decode_degree:
        return None
    return f"pdserve up --num-prefill {s.num_prefill} --num-decode {s.num_decode} --num-threads {s.decode_degree}"


def plan_text(ranked: list[Ranked], profile: Profile, top: int) -> list[str]:
    """The recommendation and a table of the best `top` shapes (modelled figures, labelled so)."""
    unit = UNIT_NAMES[profile.unit]
    best = ranked[0]
    lines = [
        f"recommended: {best.shape.label(profile.unit)}, {best.shape.units} {unit}s",
        f"predicted goodput (modelled): {rate(best.goodput.rate)} req/s, {rate(best.per_unit)} req/s per {unit} "
        f"({best.goodput.attainment:.1%} of requests within both SLOs at that rate)",
    ]
    if not best.goodput.bounded:
        lines.append(
            "  (every rate tried met the SLOs: the workload is too short to show the limit; raise --num-requests)"
        )
    if profile.unit == "core" and (cmd := up_command(best)):
        lines.append(f"  run it: {cmd}")
    header = ("rank", "shape", f"{unit}s", "goodput req/s (modelled)", f"per {unit}", "attainment", "tables")
    rows = [
        (
            str(i),
            r.shape.label(profile.unit),
            str(r.shape.units),
            rate(r.goodput.rate),
            rate(r.per_unit),
            f"{r.goodput.attainment:.1%}",
            "profiled" if r.profiled else "modelled (Amdahl)",
        )
        for i, r in enumerate(ranked[:top], 1)
    ]
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]
    lines += ["", *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])]
    if len(ranked) > top:
        lines.append(f"({len(ranked) - top} more shapes searched; --top N shows more, --json all)")
    return lines


def closest_text(r: Ranked, unit: str) -> str:
    return (
        f"the closest shape, {r.shape.label(unit)}, has {r.goodput.attainment:.1%} of requests within both SLOs "
        f"at {r.goodput.floor_rate:.3g} req/s, the lowest rate searched"
    )
