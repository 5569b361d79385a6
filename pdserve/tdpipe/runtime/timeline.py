"""Read the stages' own timelines: job span, bubble fraction, phase switches, and a PNG.

A timeline is what `stage_worker.run_stage` records, one list per stage of
`(start, end, num_tokens, phase)` spans in `time.perf_counter()` seconds. On
Linux that clock is CLOCK_MONOTONIC, shared by every process of one host, so the
stages' spans can be laid on one axis without any clock alignment.
"""

from __future__ import annotations

from pathlib import Path

Span = tuple[float, float, int, str]
Timelines = list[list[Span]]


def job_span(timelines: Timelines) -> tuple[float, float]:
    """(first start, last end) over every stage: the job's compute window, which leaves out
    process start-up and model loading (a stage's first span starts once it has loaded)."""
    spans = [s for tl in timelines for s in tl]
    if not spans:
        raise ValueError("empty timelines")
    return min(s[0] for s in spans), max(s[1] for s in spans)


def busy_seconds(timeline: list[Span]) -> float:
    return sum(end - start for start, end, _, _ in timeline)


def bubble_fractions(timelines: Timelines) -> list[float]:
    """Per stage, 1 − busy/wall over the job's span (every stage measured over the same window)."""
    t0, t1 = job_span(timelines)
    wall = max(t1 - t0, 1e-9)
    return [1.0 - busy_seconds(tl) / wall for tl in timelines]


def bubble_fraction(timelines: Timelines) -> float:
    """Mean over stages of `bubble_fractions` (the simulator's `bubble_ms / (stages * makespan)`)."""
    fr = bubble_fractions(timelines)
    return sum(fr) / len(fr)


def phase_switches(timeline: list[Span]) -> int:
    """How often consecutive spans of one stage change phase (prefill <-> decode)."""
    phases = [phase for _, _, _, phase in sorted(timeline)]
    return sum(1 for a, b in zip(phases, phases[1:]) if a != b)


COLOURS = {"prefill": "tab:blue", "decode": "tab:orange"}


def plot_timelines(runs: dict[str, Timelines], path: str | Path) -> None:
    """One panel per run: stages on the y-axis, seconds since the job's start on the x-axis,
    prefill spans (batches with any prompt token) blue and decode-only spans orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.0 + 0.9 * sum(len(t) for t in runs.values())), squeeze=False)
    for ax, (name, timelines) in zip(axes[:, 0], runs.items()):
        t0, t1 = job_span(timelines)
        for k, tl in enumerate(timelines):
            for phase in COLOURS:
                bars = [(s - t0, e - s) for s, e, _, p in tl if p == phase]
                ax.broken_barh(bars, (k - 0.4, 0.8), facecolors=COLOURS[phase], linewidth=0)
        ax.set_yticks(range(len(timelines)), [f"stage {k}" for k in range(len(timelines))])
        ax.set_ylim(len(timelines) - 0.5, -0.5)
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{name}: bubble {bubble_fraction(timelines):.0%}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the job's first batch")
    fig.legend(handles=[Patch(color=c, label=p) for p, c in COLOURS.items()], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
