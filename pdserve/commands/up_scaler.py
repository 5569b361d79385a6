"""`pdserve up --planner slo`: the cluster's nodes follow the router's SLO planner.

The router decides (pdserve/router/slo_planner.py) and exports
`pdserve_planner_desired_replicas{role}`; `up` reads it from the router's /metrics every
`--planner-interval` and starts or stops one node at a time inside its slots. A slot is one node's
share of the core budget (its threads and pinned CPUs, split once at start by
commands/core_split.py); its node may be of either role, so a role switch is a node stopped and
another started on the same cores.

Nothing is lost when a node leaves: it gets SIGTERM, stops admitting (its probes report it
draining, so the router sends it nothing new), lets its in-flight requests finish for its
`--drain-timeout` and exits. Only then does `up` drop it from the members file the router reads
(`--discovery file`): dropping it earlier would close the router's channel under the streams still
running there. A started node joins the file once it prints READY.
"""

from __future__ import annotations

import argparse
import enum
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from pdserve.node_runtime.discovery.base import ROLES
from pdserve.node_runtime.discovery.file import write_members
from pdserve.node_runtime.node_config import NodeOptions
from pdserve.node_runtime.supervisor import Supervised, Supervisor
from pdserve.router.slo_planner import PlannerConfig

DESIRED = "pdserve_planner_desired_replicas"
PRESSURE = "pdserve_planner_pressure"
DRAIN_SLACK = 15.0
"""Seconds past a node's --drain-timeout before a draining node is killed (its own shutdown)."""


class SlotState(enum.StrEnum):
    FREE = "free"
    STARTING = "starting"
    """Started, not READY yet: not in the members file."""
    SERVING = "serving"
    DRAINING = "draining"
    """SIGTERM sent: still in the members file until its process exits."""


@dataclass
class Slot:
    """One node's place in the core budget, and the node there now (None: free)."""

    index: int
    role: str | None = None
    node: Supervised | None = None
    state: SlotState = SlotState.FREE
    since: float = 0.0
    """When the state began (monotonic): a draining node past its grace is killed."""


class Wanted(NamedTuple):
    """What the router's planner wants: nodes per role, and each role's pressure behind it (its
    load over its SLO; empty when the router does not export it), which `up` prints with a change."""

    counts: dict[str, int]
    pressure: dict[str, float]

    def why(self) -> str:
        wants = " + ".join(f"{self.counts[r]} {r}" for r in ROLES)
        if not self.pressure:
            return f"the planner wants {wants}"
        return f"the planner wants {wants}; pressure " + ", ".join(
            f"{r} {self.pressure[r]:.2f}" for r in ROLES if r in self.pressure
        )


def desired_from_metrics(url: str, timeout: float = 2.0) -> Wanted | None:
    """The router's desired count per role (and pressure), read from its /metrics at `url`; None
    when it cannot be read or the planner has not exported it yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    found: dict[str, int] = {}
    pressure: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == DESIRED:
            found.update((s.labels.get("role", ""), int(s.value)) for s in family.samples)
        elif family.name == PRESSURE:
            pressure.update((s.labels.get("role", ""), s.value) for s in family.samples)
    return Wanted(found, pressure) if set(ROLES) <= set(found) else None


class RoleScaler:
    """Keeps the running nodes at the desired counts, one change at a time, within the slots."""

    def __init__(
        self,
        slots: list[Slot],
        start_node: Callable[[str, Slot], Supervised],
        supervisor: Supervisor,
        members_file: str,
        desired: Callable[[], Wanted | None],
        interval: float,
        drain_grace: float,
        log: Callable[[str], None] = print,
    ) -> None:
        """`start_node(role, slot)`: a Supervised for a node of `role` on `slot`'s cores (not started);
        `drain_grace`: seconds a draining node may take before it is killed (its --drain-timeout and
        some)."""
        self.slots = slots
        self.start_node = start_node
        self.supervisor = supervisor
        self.members_file = members_file
        self.desired = desired
        self.interval = interval
        self.drain_grace = drain_grace
        self.log = log
        self._next = 0.0

    def counts(self) -> dict[str, int]:
        """Nodes per role that are, or are about to be, serving (a draining node is leaving)."""
        found = dict.fromkeys(ROLES, 0)
        for s in self.slots:
            if s.role is not None and s.state in (SlotState.STARTING, SlotState.SERVING):
                found[s.role] += 1
        return found

    def write_members(self) -> None:
        """The members file: every node that serves or drains (in-flight streams still use it)."""
        listed = [s for s in self.slots if s.state in (SlotState.SERVING, SlotState.DRAINING) and s.node]
        addresses = {role: [f"127.0.0.1:{s.node.port}" for s in listed if s.role == role and s.node] for role in ROLES}
        write_members(self.members_file, addresses["prefill"], addresses["decode"])

    def poll(self, now: float) -> None:
        """Called from `up`'s supervision loop: settle the change under way; every interval, with
        none under way, make the next one."""
        self._settle(now)
        if now < self._next:
            return
        self._next = now + self.interval
        if any(s.state in (SlotState.STARTING, SlotState.DRAINING) for s in self.slots):
            return  # one change at a time: the planner judges each one before the next
        want = self.desired()
        if want is None:
            return
        have = self.counts()
        for role in ROLES:  # shrink first: a role switch frees the slot the other role then takes
            if have[role] > want.counts[role] and (role == "prefill" or have[role] > 1):
                serving = [s for s in self.slots if s.role == role and s.state == SlotState.SERVING]
                if serving:
                    self._drain(serving[-1], now, want.why())
                    return
        for role in ROLES:
            free = next((s for s in self.slots if s.state == SlotState.FREE), None)
            if have[role] < want.counts[role] and free is not None:
                self._start(role, free, now, want.why())
                return

    def _start(self, role: str, slot: Slot, now: float, why: str) -> None:
        node = self.start_node(role, slot)
        slot.role, slot.node, slot.state, slot.since = role, node, SlotState.STARTING, now
        node.start()
        self.log(f"planner: starting {node.name} (slot {slot.index}): {why}")

    def _drain(self, slot: Slot, now: float, why: str) -> None:
        assert slot.node is not None and slot.node.child is not None
        self.supervisor.members.remove(slot.node)  # a node that exits on purpose is not restarted
        slot.node.child.send(signal.SIGTERM)
        slot.state, slot.since = SlotState.DRAINING, now
        self.log(f"planner: draining {slot.node.name} (its requests finish first): {why}")

    def _settle(self, now: float) -> None:
        for slot in self.slots:
            node = slot.node
            child = node.child if node else None
            if node is None or child is None:
                continue
            if slot.state == SlotState.STARTING and child.address:
                node.port = int(child.address.rsplit(":", 1)[1])
                slot.state, slot.since = SlotState.SERVING, now
                self.supervisor.members.append(node)  # restarted on its port if it dies from now on
                self.write_members()
                self.log(f"planner: {node.name} serves at {child.address}")
            elif slot.state == SlotState.STARTING and child.exited:
                self.log(f"planner: {node.name} failed to start:\n{child.tail()}")
                self._free(slot)
            elif slot.state == SlotState.DRAINING and (child.exited or now - slot.since > self.drain_grace):
                if not child.exited:
                    self.log(f"planner: {node.name} still draining after {self.drain_grace:.0f} s: killed")
                    child.stop(signal.SIGKILL, grace=5.0)
                self._free(slot)
                self.write_members()
                self.log(f"planner: {node.name} stopped")

    @staticmethod
    def _free(slot: Slot) -> None:
        slot.role, slot.node, slot.state = None, None, SlotState.FREE

    def stop(self) -> None:
        """At `up`'s exit: stop the nodes starting or draining (the supervisor stops the others) and
        remove the members file."""
        for slot in self.slots:
            if slot.state in (SlotState.STARTING, SlotState.DRAINING) and slot.node and slot.node.child:
                slot.node.child.stop()
        shutil.rmtree(os.path.dirname(self.members_file), ignore_errors=True)


def planner_slots(args: argparse.Namespace, planner: PlannerConfig, num_nodes: int) -> int | None:
    """How many node slots `up` splits the cores into: its nodes, or with the planner on enough for
    its budget; None (after printing why) when the planner cannot move nodes between roles."""
    if not planner.enabled:
        return num_nodes
    tp = {getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size for role in ROLES}
    if len(tp) > 1:
        print(
            "error: --planner slo on `up` moves nodes between roles on the same cores: give both roles one "
            "tensor-parallel size (--tensor-parallel-size), not --prefill/--decode-tensor-parallel-size apart",
            file=sys.stderr,
        )
        return None
    least = 1 + max(planner.planner_min_prefill, 1)
    return max(num_nodes, planner.planner_max_nodes or 0, least)


def make_scaler(
    args: argparse.Namespace,
    planner: PlannerConfig,
    num_slots: int,
    nodes: list[tuple[str, Supervised]],
    node_at: Callable[[str, int, str, int], Supervised],
    supervisor: Supervisor,
    router_url: str,
) -> RoleScaler:
    """The RoleScaler of `up`: `nodes` (role, node) already serving on the first slots, the rest free;
    the members file written for the router to start from."""
    slots = [Slot(i, role, node, SlotState.SERVING) for i, (role, node) in enumerate(nodes)]
    slots += [Slot(i) for i in range(len(nodes), num_slots)]
    names = {role: itertools.count(sum(1 for r, _ in nodes if r == role)) for role in ROLES}

    def start_node(role: str, slot: Slot) -> Supervised:
        port = args.base_port + slot.index if args.base_port else 0
        return node_at(role, slot.index, f"{role}-{next(names[role])}", port)

    members_file = os.path.join(tempfile.mkdtemp(prefix="pdserve-members-"), "members.json")
    scaler = RoleScaler(
        slots,
        start_node,
        supervisor,
        members_file,
        lambda: desired_from_metrics(f"{router_url}/metrics"),
        planner.planner_interval,
        NodeOptions.drain_timeout + DRAIN_SLACK,
        log=lambda msg: print(f"[up] {time.strftime('%H:%M:%S')} {msg}", flush=True),  # when the shape moved
    )
    scaler.write_members()
    return scaler
