"""Run the schedulers on a cost table and workload; summarise and plot the result."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from tdpipe.config import InstanceConfig, TDPipeOptions
from tdpipe.cost_table import CostTable
from tdpipe.pipeline import SimStats
from tdpipe.pp_scheduler import PPScheduler
from tdpipe.td_scheduler import TDPipeScheduler
from tdpipe.workload import SimRequest

Runner = Callable[[CostTable, InstanceConfig, list[SimRequest]], SimStats]


def _td(name: str, **opts: object) -> Runner:
    return lambda table, inst, reqs: TDPipeScheduler(table, inst, TDPipeOptions(**opts), name).run(reqs)


POLICIES: dict[str, Runner] = {
    "td-pipe": _td("td-pipe"),
    "td-pipe-no-stealing": _td("td-pipe-no-stealing", work_stealing=False),
    "td-pipe-kv-threshold": _td("td-pipe-kv-threshold", prefill_switch="kv_threshold"),
    "td-pipe-completion": _td("td-pipe-completion", decode_switch="completion"),
    "pp+sb": lambda table, inst, reqs: PPScheduler(table, inst, hybrid=False).run(reqs),
    "pp+hb": lambda table, inst, reqs: PPScheduler(table, inst, hybrid=True).run(reqs),
}
"""Every policy the simulator compares; ablations change one TD-Pipe policy each."""


def simulate(policy: str, table: CostTable, inst: InstanceConfig, requests: list[SimRequest]) -> SimStats:
    """Run `policy` on a private copy of `requests` (runs never share mutable state)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    stats = POLICIES[policy](table, inst, copy.deepcopy(requests))
    expected = sum(r.output_len for r in requests)
    assert stats.output_tokens == expected, f"{policy}: {stats.output_tokens} tokens != {expected}"
    return stats


def plot_kv_usage(results: list[SimStats], path: str | Path) -> None:
    """KV usage over time with prefill/decode phases shaded (the paper's Fig. 12 style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.4 * len(results)), squeeze=False)
    for ax, stats in zip(axes[:, 0], results):
        samples = sorted(stats.kv_samples)
        ax.plot([t / 1000 for t, _ in samples], [u * 100 for _, u in samples], color="black", lw=0.8)
        switches = stats.phase_switches + [(stats.makespan_ms, "end")]
        for (t0, phase), (t1, _) in zip(switches, switches[1:]):
            ax.axvspan(t0 / 1000, t1 / 1000, alpha=0.25, lw=0,
                       color="tab:blue" if phase == "prefill" else "gold")
        ax.set_ylim(0, 105)
        ax.set_ylabel("KV usage %")
        ax.set_title(f"{stats.name}: {stats.throughput:.0f} tok/s", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)   blue = prefill phase, yellow = decode phase")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
