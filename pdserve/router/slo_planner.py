"""The runtime SLO planner's decision core: how many prefill and decode nodes the cluster should have.

Pure (no I/O, no clock of its own): every `--planner-interval` the router hands `SloPlanner.decide`
an `Observation` of its last `--planner-window` seconds and gets a `Decision` back
(router/planner_loop.py does the sampling and exports the result as gauges).

Each role gets a pressure, 1.0 meaning "exactly at its SLO":

- prefill: the TTFT quantile over `--ttft-slo`. The router's TTFT includes the time a request
  waited in its admission queue, and demand that backpressure hides counts too: a request still
  waiting counts with its wait so far (a lower bound of its TTFT), and a request refused for
  capacity counts as an infinite TTFT. A burst that the admission queue holds back therefore shows
  as pressure, although the few requests that finished had a fine TTFT;
- decode: the larger of the TPOT quantile over `--tpot-slo` and decode KV usage over `kv_high`.
  TTFT misses with no prefill backlog while decode KV is full are decode's (requests wait for KV
  room, not for a prefill node).

Stability, the failure the anchors' users report most (oscillation between two sizes):

- hysteresis: a role grows above `scale_up_pressure` and shrinks only below `scale_down_pressure`,
  and only when its pressure scaled to one node fewer (p * n / (n - 1)) stays under the upper
  threshold, so a shrink never lands it where it would grow again;
- dwell: a role that changed is left alone for `--planner-dwell` seconds (a new node must start,
  and a full window must observe the new shape before the next judgement);
- one change per decision: +1 or -1 node, or one node moving between roles.

A decode node that takes prompts off saturated prefill nodes (the router's offload) is not idle
while prefill is not: it is not removed then, however low its own TPOT and KV pressure. Measured on
`benchmarks/planner_shift.py` before this rule, the planner removed a decode node in each
prefill-heavy phase and TTFT suffered (the offload lost a node), then added it back.

At the budget (`--planner-max-nodes`) a short role takes a node from the other role only when the
other has slack by the same projection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.node_runtime.discovery.base import ROLES, Role

PLANNERS = ("off", "slo")
MAX_PRESSURE = 10.0
"""Reported pressure is capped here (a refused request's TTFT is infinite; a gauge wants a number)."""
PREFILL, DECODE = Role.PREFILL, Role.DECODE


@dataclass(frozen=True)
class PlannerConfig:
    """The runtime SLO planner's settings (`pdserve router --planner slo`)."""

    planner: str = "off"
    """off: no planner; slo: every --planner-interval the router judges TTFT (queue time included),
    TPOT, decode KV usage and prefill backlog against the SLOs and exports the prefill and decode
    node counts it wants as pdserve_planner_desired_replicas{role}, which KEDA/HPA or `pdserve up`
    act on (the router itself starts and stops no node)."""
    ttft_slo: float | None = None
    """Time-to-first-token SLO in seconds, as the client sees it (needed with --planner slo)."""
    tpot_slo: float | None = None
    """Time-per-output-token SLO in seconds (needed with --planner slo). Set, with or without the
    planner, a decode node also takes no prompt off saturated prefill nodes that would pause its
    streams past it (router/prefill_offload.py)."""
    planner_interval: float = 10.0
    """Seconds between two planner decisions."""
    planner_window: float = 30.0
    """Seconds of finished requests and refusals each decision looks at."""
    planner_dwell: float = 60.0
    """Seconds a role's desired count stays put after it changed (hysteresis in time: a new node
    must start and a window must observe it first)."""
    planner_max_nodes: int | None = None
    """Budget: prefill + decode nodes the planner may want at most (unset: the nodes discovery lists
    when the planner starts, at least 2; on `up`, its node slots)."""
    planner_min_prefill: int = 1
    """Fewest prefill nodes the planner may want (0: decode nodes may prefill everything)."""
    planner_min_nodes: int | None = None
    """Fewest prefill + decode nodes the planner may want, like an autoscaler's minimum replicas: at
    it an idle role gives no node back, and nodes only move between roles (unset: one decode node
    and --planner-min-prefill; on `up`, the nodes it starts with, since its cores are held anyway)."""
    slo_quantile: float = 0.9
    """The share of requests that must meet each SLO (the quantile judged)."""
    scale_up_pressure: float = 1.0
    """A role whose pressure (its quantile over its SLO) exceeds this gets a node."""
    scale_down_pressure: float = 0.5
    """A role gives a node back only below this (the hysteresis band lies between the two)."""
    kv_high: float = 0.9
    """Decode KV usage that counts as pressure 1.0."""

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"--planner must be one of {', '.join(PLANNERS)}, got {self.planner!r}")
        for flag, value in (("--ttft-slo", self.ttft_slo), ("--tpot-slo", self.tpot_slo)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
            if value is None and self.planner == "slo":
                raise ValueError(f"--planner slo needs {flag} (seconds)")
        if not self.planner_interval > 0:
            raise ValueError(f"--planner-interval must be > 0 seconds, got {self.planner_interval}")
        if self.planner_window < self.planner_interval:
            raise ValueError(
                f"--planner-window ({self.planner_window:g} s) must be >= --planner-interval "
                f"({self.planner_interval:g} s): a decision must see every request since the last one"
            )
        if self.planner_dwell < 0:
            raise ValueError(f"--planner-dwell must be >= 0 seconds, got {self.planner_dwell}")
        if self.planner_min_prefill not in (0, 1):
            raise ValueError(f"--planner-min-prefill must be 0 or 1, got {self.planner_min_prefill}")
        if self.planner_max_nodes is not None:
            check_budget(self.planner_max_nodes, self.planner_min_prefill)
        if self.planner_min_nodes is not None:
            least = 1 + self.planner_min_prefill
            if self.planner_min_nodes < least:
                raise ValueError(f"--planner-min-nodes must be >= {least}, got {self.planner_min_nodes}")
            if self.planner_max_nodes is not None and self.planner_min_nodes > self.planner_max_nodes:
                raise ValueError(
                    f"--planner-min-nodes ({self.planner_min_nodes}) must be <= --planner-max-nodes "
                    f"({self.planner_max_nodes})"
                )
        if not 0 < self.slo_quantile < 1:
            raise ValueError(f"slo_quantile must be in (0, 1), got {self.slo_quantile}")
        if not 0 < self.scale_down_pressure < self.scale_up_pressure:
            raise ValueError("scale_down_pressure must be > 0 and below scale_up_pressure")
        if not 0 < self.kv_high <= 1:
            raise ValueError(f"kv_high must be in (0, 1], got {self.kv_high}")

    @property
    def enabled(self) -> bool:
        return self.planner != "off"


def check_budget(max_nodes: int, min_prefill: int) -> int:
    """`max_nodes` when it holds one decode node and the prefill minimum, else ValueError naming the flag."""
    least = 1 + max(min_prefill, 1)
    if max_nodes < least:
        raise ValueError(f"--planner-max-nodes must be >= {least} (one prefill + one decode node), got {max_nodes}")
    return max_nodes


@dataclass(frozen=True)
class Observation:
    """What the router saw over one window; the planner's only input."""

    now: float
    """When it was taken (seconds, monotonic: dwell is measured on it)."""
    num_prefill: int
    num_decode: int
    """Nodes discovery lists per role."""
    ttfts: Sequence[float] = ()
    """TTFT of the requests that finished in the window, as the router measured it (queue time included)."""
    tpots: Sequence[float] = ()
    """Mean time per output token of each request that finished in the window with two tokens or more."""
    waiting: Sequence[float] = ()
    """Seconds each request now in the router's admission queue has waited so far."""
    refused: int = 0
    """Requests refused for capacity in the window (503: full queue, or no room within --capacity-wait)."""
    kv_usage: float = 0.0
    """Share of decode KV blocks in use (0..1) over the decode nodes' last load reports."""
    prefill_backlog: float = 0.0
    """Seconds of prompt work pending on the busiest node that prefills (router/saturation.py; inf
    while a node with work pending has not been measured yet)."""
    decode_prefills: bool = False
    """Decode nodes take prompts off saturated prefill nodes (the router's offload is on): a decode
    node then works for prefill too, and its TPOT and KV alone do not show that."""


class Pressure(NamedTuple):
    """Each role's load over its SLO: 1.0 is at the SLO, above it the role is short."""

    prefill: float
    decode: float

    def of(self, role: str) -> float:
        return self.prefill if role == PREFILL else self.decode


@dataclass(frozen=True)
class Decision:
    """One decision: the counts wanted now, what changed, and why."""

    num_prefill: int
    num_decode: int
    action: str
    """hold, add_prefill, add_decode, remove_prefill, remove_decode, move_to_prefill or move_to_decode."""
    pressure: Pressure
    reason: str = ""


def quantile_with_misses(samples: Sequence[float], misses: int, q: float) -> float:
    """The q-quantile of `samples` plus `misses` values known to be infinite (requests refused):
    inf when the misses reach into the quantile, 0.0 with nothing observed."""
    total = len(samples) + misses
    if total == 0:
        return 0.0
    rank = max(0, math.ceil(q * total) - 1)
    ordered = sorted(samples)
    return ordered[rank] if rank < len(ordered) else math.inf


def pressure(obs: Observation, config: PlannerConfig) -> Pressure:
    """Each role's pressure from one observation (the module docstring says how)."""
    assert config.ttft_slo and config.tpot_slo, "the planner runs with both SLOs set"
    q = config.slo_quantile
    # a waiting request's TTFT is at least its wait so far; a refused one never gets a TTFT
    ttft = quantile_with_misses([*obs.ttfts, *obs.waiting], obs.refused, q) / config.ttft_slo
    tpot = quantile_with_misses(obs.tpots, 0, q) / config.tpot_slo
    kv = obs.kv_usage / config.kv_high
    backlog = obs.prefill_backlog / config.ttft_slo
    # TTFT misses with decode KV full and little prompt work pending: requests wait for KV room
    waits_for_kv = kv >= 1.0 and backlog < 0.25
    prefill = backlog if waits_for_kv else ttft
    decode = max(tpot, kv, ttft if waits_for_kv else 0.0)
    return Pressure(min(prefill, MAX_PRESSURE), min(decode, MAX_PRESSURE))


@dataclass
class SloPlanner:
    """Desired prefill and decode counts, changed one node at a time within the budget.

    It starts from the counts it is given and afterwards moves from its own last decision, not
    from the nodes that exist: a node asked for takes minutes to start, and judging the old count
    again would ask for a second one (the dwell covers the start)."""

    config: PlannerConfig
    num_prefill: int
    num_decode: int
    max_nodes: int
    changed_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROLES, -math.inf))

    def __post_init__(self) -> None:
        check_budget(self.max_nodes, self.config.planner_min_prefill)
        # what exists may lie outside the budget or the minimums: start from the nearest counts inside
        self.num_decode = max(1, min(self.num_decode, self.max_nodes - self.config.planner_min_prefill))
        self.num_prefill = max(self.config.planner_min_prefill, min(self.num_prefill, self.max_nodes - self.num_decode))

    def count(self, role: str) -> int:
        return self.num_prefill if role == PREFILL else self.num_decode

    def least(self, role: str) -> int:
        return self.config.planner_min_prefill if role == PREFILL else 1

    def decide(self, obs: Observation) -> Decision:
        """The counts wanted after `obs` (at most one node changes)."""
        p = pressure(obs, self.config)
        up = self.config.scale_up_pressure
        ready = [r for r in ROLES if obs.now - self.changed_at[r] >= self.config.planner_dwell]
        short = sorted((r for r in ROLES if p.of(r) > up), key=p.of, reverse=True)
        if short:  # the worst short role that may change now; none: hold, and shrink nothing either
            role = next((r for r in short if r in ready), None)
            if role is None:
                return self._hold(p, f"{short[0]} short but within --planner-dwell")
            if self.num_prefill + self.num_decode < self.max_nodes:
                return self._change(obs.now, p, f"add_{role}", {role: +1}, f"{role} pressure {p.of(role):.2f}")
            donor = DECODE if role == PREFILL else PREFILL
            if donor in ready and self._has_slack(donor, p.of(donor), up, p):
                return self._change(
                    obs.now, p, f"move_to_{role}", {role: +1, donor: -1}, f"at the budget; {donor} has slack"
                )
            return self._hold(p, f"{role} short at the budget, {donor} has no slack")
        down = self.config.scale_down_pressure
        idle = sorted(
            (
                r
                for r in ready
                if p.of(r) < down
                and self._has_slack(r, p.of(r), up, p)
                # a decode node prefills offloaded prompts: it is not idle while prefill is not
                and not (r == DECODE and obs.decode_prefills and p.prefill >= down)
            ),
            key=p.of,
        )
        if idle and self.num_prefill + self.num_decode > (self.config.planner_min_nodes or 0):
            role = idle[0]
            return self._change(obs.now, p, f"remove_{role}", {role: -1}, f"{role} pressure {p.of(role):.2f}")
        return self._hold(p, "at --planner-min-nodes" if idle else "every role inside its band")

    def _has_slack(self, role: str, value: float, up: float, p: Pressure) -> bool:
        """`role` can lose a node and stay below the upper threshold (its load over one node fewer);
        the last prefill node's work falls on decode, so that takes both roles below the lower one."""
        n = self.count(role)
        if n <= self.least(role):
            return False
        if n == 1:  # prefill to 0: decode nodes prefill everything
            return max(p) < self.config.scale_down_pressure
        return value * n / (n - 1) < up

    def _change(self, now: float, p: Pressure, action: str, delta: dict[str, int], reason: str) -> Decision:
        for role, d in delta.items():
            if role == PREFILL:
                self.num_prefill += d
            else:
                self.num_decode += d
            self.changed_at[role] = now
        assert self.num_decode >= 1 and self.num_prefill >= self.config.planner_min_prefill
        assert self.num_prefill + self.num_decode <= self.max_nodes, "the budget holds"
        return Decision(self.num_prefill, self.num_decode, action, p, reason)

    def _hold(self, p: Pressure, reason: str) -> Decision:
        return Decision(self.num_prefill, self.num_decode, "hold", p, reason)
