"""Run the schedulers on a cost table and workload; summarise and plot the result."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Phase
from pdserve.tdpipe.pipeline import SimStats
from pdserve.tdpipe.pp_scheduler import PPScheduler
from pdserve.tdpipe.td_overlap import OverlapTDPipe
from pdserve.tdpipe.td_scheduler import TDPipeScheduler
from pdserve.tdpipe.workload import SimRequest

Policy = TDPipeScheduler | OverlapTDPipe | PPScheduler
"""A policy object: `policy.run(requests, executor=None) -> SimStats` (simulator by default)."""
PolicyFactory = Callable[[CostTable, InstanceConfig], Policy]


def _td(name: str, overlap: bool = False, **opts: object) -> PolicyFactory:
    cls = OverlapTDPipe if overlap else TDPipeScheduler
    return lambda table, inst: cls(table, inst, TDPipeOptions(**opts), name)  # type: ignore[arg-type]


POLICIES: dict[str, PolicyFactory] = {
    "td-pipe": _td("td-pipe"),
    "td-pipe-overlap": _td("td-pipe-overlap", overlap=True),
    "td-pipe-no-stealing": _td("td-pipe-no-stealing", work_stealing=False),
    "td-pipe-kv-threshold": _td("td-pipe-kv-threshold", prefill_switch="kv_threshold"),
    "td-pipe-completion": _td("td-pipe-completion", decode_switch="completion"),
    "td-pipe-whole-prompts": _td("td-pipe-whole-prompts", chunk_prefills=False),
    # the runtime's ablation of held first tokens (the simulator prices it as td-pipe)
    "td-pipe-head-per-batch": _td("td-pipe-head-per-batch", hold_first_tokens=False),
    "pp+sb": lambda table, inst: PPScheduler(table, inst, hybrid=False),
    "pp+hb": lambda table, inst: PPScheduler(table, inst, hybrid=True),
}
"""Every policy the simulator compares; ablations change one TD-Pipe policy each."""

CLI_NAMES = {"tdpipe": "td-pipe", "pp-sb": "pp+sb", "pp-hb": "pp+hb"}
"""`pdserve batch --policy` names (shell-friendly) of the policies above."""


def make_policy(policy: str, table: CostTable, inst: InstanceConfig) -> Policy:
    """A fresh policy object by name (simulator name or `pdserve batch` name)."""
    name = CLI_NAMES.get(policy, policy)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)} or {sorted(CLI_NAMES)}")
    return POLICIES[name](table, inst)


def simulate(policy: str, table: CostTable, inst: InstanceConfig, requests: list[SimRequest]) -> SimStats:
    """Run `policy` on a private copy of `requests` (runs never share mutable state)."""
    policy_obj = make_policy(policy, table, inst)
    stats = policy_obj.run(copy.deepcopy(requests))
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
            ax.axvspan(t0 / 1000, t1 / 1000, alpha=0.25, lw=0, color="tab:blue" if phase == Phase.PREFILL else "gold")
        ax.set_ylim(0, 105)
        ax.set_ylabel("KV usage %")
        ax.set_title(f"{stats.name}: {stats.throughput:.0f} tok/s", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)   blue = prefill phase, yellow = decode phase")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
