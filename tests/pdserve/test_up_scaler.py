"""`pdserve up --planner slo` (commands/up_scaler.py): nodes follow the planner's desired counts one
change at a time, a leaving node drains before the router's members file drops it, and a new node
joins the file once READY. Stand-in node processes (a READY line; SIGTERM: a short drain)."""

from __future__ import annotations

import json
import sys
import time

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.commands.up_scaler import RoleScaler, Slot, SlotState, Wanted, desired_from_metrics
from pdserve.node_runtime.supervisor import Supervised, Supervisor

NODE = """
import signal, sys, time
def drain(*_):
    time.sleep({drain})  # in-flight requests finishing
    sys.exit(0)
signal.signal(signal.SIGTERM, drain if {drain} >= 0 else signal.SIG_IGN)
print("READY {role} 127.0.0.1:{port}", flush=True)
while True:
    time.sleep(0.05)
"""
PORTS = iter(range(41000, 42000))


def fake_node(role: str, name: str, drain: float = 0.3) -> Supervised:
    port = next(PORTS)
    return Supervised(name, lambda p: [sys.executable, "-c", NODE.format(role=role, port=p, drain=drain)], port, {})


def members(scaler: RoleScaler) -> dict[str, list[int]]:
    with open(scaler.members_file) as f:
        data = json.load(f)
    return {role: [int(a.rsplit(":", 1)[1]) for a in addrs] for role, addrs in data.items()}


def cluster(tmp_path, want: dict[str, int], drain: float = 0.3, grace: float = 30.0) -> RoleScaler:
    """1 prefill + 2 decode stand-ins serving on 3 of 4 slots."""
    nodes = [("prefill", fake_node("prefill", "prefill-0")), ("decode", fake_node("decode", "decode-0"))]
    nodes.append(("decode", fake_node("decode", "decode-1", drain)))
    for _, n in nodes:
        n.start()
        n.wait_ready(time.monotonic() + 30)
    slots = [Slot(i, role, n, SlotState.SERVING) for i, (role, n) in enumerate(nodes)] + [Slot(3)]
    scaler = RoleScaler(
        slots,
        lambda role, slot: fake_node(role, f"{role}-new"),
        Supervisor([n for _, n in nodes], log=lambda m: None),
        str(tmp_path / "members.json"),
        lambda: Wanted(dict(want), {}),
        interval=0.2,
        drain_grace=grace,
        log=lambda m: None,
    )
    scaler.write_members()
    return scaler


def poll_until(scaler: RoleScaler, pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scaler.poll(time.monotonic())
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached: {[(s.role, s.state) for s in scaler.slots]}")


def test_a_role_switch_drains_the_leaving_node_first_then_starts_the_new_one(tmp_path):
    want = {"prefill": 2, "decode": 1}
    scaler = cluster(tmp_path, want)
    try:
        leaving = scaler.slots[2].node
        assert leaving is not None
        scaler.poll(time.monotonic())
        assert scaler.slots[2].state == SlotState.DRAINING
        assert leaving not in scaler.supervisor.members  # exits on purpose: not restarted
        assert leaving.port in members(scaler)["decode"]  # still listed while its requests finish
        assert scaler.slots[3].state == SlotState.FREE  # one change at a time
        poll_until(scaler, lambda: leaving.port not in members(scaler)["decode"])
        assert leaving.child is not None and leaving.child.exited
        poll_until(scaler, lambda: len(members(scaler)["prefill"]) == 2)
        assert scaler.counts() == want
        new = next(s.node for s in scaler.slots if s.role == "prefill" and s.index != 0)
        assert new in scaler.supervisor.members  # restarted on its port from now on
        for _ in range(5):  # at the desired counts: nothing more changes
            scaler.poll(time.monotonic() + 10)
        assert scaler.counts() == want and not any(s.state == SlotState.STARTING for s in scaler.slots)
    finally:
        scaler.stop()
        scaler.supervisor.stop()


def test_a_node_that_will_not_drain_is_killed_after_its_grace_and_the_last_decode_node_stays(tmp_path):
    scaler = cluster(tmp_path, {"prefill": 1, "decode": 0}, drain=-1, grace=0.5)
    try:
        stuck = scaler.slots[2].node
        assert stuck is not None and stuck.child is not None
        poll_until(scaler, lambda: stuck.child is not None and stuck.child.exited)
        poll_until(scaler, lambda: members(scaler)["decode"] == [scaler.slots[1].node.port])
        for _ in range(5):
            scaler.poll(time.monotonic() + 10)
        assert scaler.counts() == {"prefill": 1, "decode": 1}  # decode never goes below one node
    finally:
        scaler.stop()
        scaler.supervisor.stop()


def test_desired_counts_are_read_from_the_routers_metrics(tmp_path):
    from prometheus_client import Gauge

    registry = CollectorRegistry()
    page = tmp_path / "metrics"
    page.write_bytes(generate_latest(registry))
    assert desired_from_metrics(page.as_uri()) is None  # not exported yet
    gauge = Gauge("pdserve_planner_desired_replicas", "", ["model_name", "role"], registry=registry)
    gauge.labels("m", "prefill").set(2)
    gauge.labels("m", "decode").set(3)
    page.write_bytes(generate_latest(registry))
    assert desired_from_metrics(page.as_uri()) == Wanted({"prefill": 2, "decode": 3}, {})
    pressure = Gauge("pdserve_planner_pressure", "", ["model_name", "role"], registry=registry)
    pressure.labels("m", "prefill").set(1.25)
    pressure.labels("m", "decode").set(0.5)
    page.write_bytes(generate_latest(registry))
    wanted = desired_from_metrics(page.as_uri())
    assert wanted == Wanted({"prefill": 2, "decode": 3}, {"prefill": 1.25, "decode": 0.5})
    assert wanted.why() == "the planner wants 2 prefill + 3 decode; pressure prefill 1.25, decode 0.50"
    assert desired_from_metrics((tmp_path / "gone").as_uri()) is None
