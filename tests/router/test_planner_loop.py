"""The SLO planner inside the router (router/planner_loop.py): it samples the router's own state
(finished requests, the admission queue, the node table of a Cluster on in-process fake nodes) and
exports its decision as metrics; `pdserve router` and `pdserve up` take its flags."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from pdserve.router.admission import QueueFull
from pdserve.router.planner_loop import PlannerLoop
from pdserve.router.request_metrics import RequestMetrics
from pdserve.router.request_window import RequestWindow
from pdserve.router.slo_planner import PlannerConfig
from pdserve.v1 import common_pb2, decode_pb2
from tests.router.fake_nodes import FakeNode, fake_cluster

NODES = {
    ("prefill", "127.0.0.1:1"): FakeNode(),
    ("decode", "127.0.0.1:2"): FakeNode(),
    ("decode", "127.0.0.1:3"): FakeNode(),
}


async def planner_on_fakes(max_waiting: int = 8, **kw) -> tuple[PlannerLoop, CollectorRegistry]:
    """A PlannerLoop over a started Cluster of 1 prefill + 2 decode fake nodes (refreshed only at start,
    so a test may set the nodes' loads itself)."""
    registry = CollectorRegistry()
    cluster = await fake_cluster(
        dict(NODES), refresh_interval=3600, registry=registry, max_waiting_requests=max_waiting
    )
    base = dict(planner="slo", ttft_slo=2.0, tpot_slo=0.1, planner_interval=1.0, planner_dwell=0.0)
    config = PlannerConfig(**{**base, **kw})
    loop = PlannerLoop(config, cluster, RequestWindow(config.planner_window), registry, "m")
    loop.begin()
    return loop, registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, {"model_name": "m", **labels})
    assert found is not None, f"{name}{labels} not exported"
    return found


async def test_desired_replicas_start_from_the_nodes_discovery_lists():
    loop, registry = await planner_on_fakes()
    try:
        assert value(registry, "pdserve_planner_desired_replicas", role="prefill") == 1
        assert value(registry, "pdserve_planner_desired_replicas", role="decode") == 2
        assert loop.planner is not None and loop.planner.max_nodes == 3  # no --planner-max-nodes: what exists
        decision = loop.step(time.monotonic())  # an idle router: nothing to shrink below the minimums but decode
        assert decision.action == "remove_decode"
        assert value(registry, "pdserve_planner_decisions_total", action="remove_decode") == 1
    finally:
        await loop.cluster.stop()


async def test_refused_requests_scale_prefill_up_with_no_ttft_measured():
    """A burst the admission queue refuses (a full queue answers 503 before any work) leaves no TTFT
    behind; the planner counts the refusals as misses."""
    loop, registry = await planner_on_fakes(max_waiting=0, planner_max_nodes=4)
    try:
        for _ in range(20):
            with pytest.raises(QueueFull):
                loop.cluster.check_admission()
        decision = loop.step(time.monotonic())
        assert decision.action == "add_prefill"
        assert value(registry, "pdserve_planner_desired_replicas", role="prefill") == 2
        assert value(registry, "pdserve_planner_pressure", role="prefill") == 10.0  # capped infinity
        # the refusals were counted once: the next window holds them still, no new ones
        assert loop.observe(time.monotonic()).refused == 20
    finally:
        await loop.cluster.stop()


async def test_full_decode_kv_in_the_load_reports_scales_decode_up():
    loop, registry = await planner_on_fakes(planner_max_nodes=4)
    try:
        for (role, _), node in loop.cluster.nodes.items():
            if role == "decode":
                node.load.free_blocks = 30  # of 1000: 97% used
        obs = loop.observe(time.monotonic())
        assert obs.kv_usage == pytest.approx(0.97) and (obs.num_prefill, obs.num_decode) == (1, 2)
        assert loop.step(time.monotonic()).action == "add_decode"
        assert value(registry, "pdserve_planner_desired_replicas", role="decode") == 3
    finally:
        await loop.cluster.stop()


async def _stream(n: int):
    for i in range(n):
        last = i == n - 1
        usage = common_pb2.Usage(prompt_tokens=5, completion_tokens=n) if last else None
        yield decode_pb2.GenerateEvent(token_ids=[i], finish_reason="length" if last else "", usage=usage)


async def test_request_metrics_fill_the_window_with_ttft_including_queue_time():
    window = RequestWindow(30.0)
    metrics = RequestMetrics(CollectorRegistry(), "m", window=window)
    arrived = time.monotonic() - 1.5  # waited 1.5 s in the admission queue before its stream began
    async for _ in metrics.track(_stream(3), arrived):
        pass
    async for _ in metrics.track(_stream(0)):  # no token: no TTFT to sample
        pass
    ttfts, tpots, refused = window.read(time.monotonic())
    assert len(ttfts) == 1 and ttfts[0] >= 1.5
    assert len(tpots) == 1 and refused == 0
    assert window.read(time.monotonic() + 31.0) == ([], [], 0)  # out of the window


def test_the_router_and_up_take_the_planner_flags():
    from pdserve.cli import build_parser
    from pdserve.commands.router import router_config

    parser = build_parser()
    flags = ["--planner", "slo", "--ttft-slo", "2", "--tpot-slo", "0.1", "--planner-max-nodes", "6"]
    flags += ["--planner-min-nodes", "3"]
    config = router_config(parser.parse_args(["router", *flags])).slo_planner
    assert config.enabled and config.ttft_slo == 2.0 and (config.planner_min_nodes, config.planner_max_nodes) == (3, 6)
    assert not router_config(parser.parse_args(["router"])).slo_planner.enabled
    up = parser.parse_args(["up", *flags])
    assert (up.planner, up.ttft_slo, up.planner_min_nodes, up.planner_max_nodes) == ("slo", 2.0, 3, 6)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--planner", "slo", "--tpot-slo", "0.1"], "--ttft-slo"),
        (["--planner", "slo", "--ttft-slo", "0", "--tpot-slo", "0.1"], "--ttft-slo"),
        (
            ["--planner", "slo", "--ttft-slo", "2", "--tpot-slo", "0.1", "--planner-max-nodes", "1"],
            "--planner-max-nodes",
        ),
        (
            ["--planner", "slo", "--ttft-slo", "2", "--tpot-slo", "0.1", "--planner-min-nodes", "4"]
            + ["--planner-max-nodes", "3"],
            "--planner-min-nodes",
        ),
    ],
)
def test_bad_planner_flags_exit_naming_the_flag(flags, named, capsys):
    from pdserve.cli import build_parser
    from pdserve.commands.router import router_config

    with pytest.raises(SystemExit, match=named):
        router_config(build_parser().parse_args(["router", *flags]))


def test_up_refuses_bad_planner_flags_before_any_node_starts(capsys):
    from pdserve.cli import build_parser
    from pdserve.commands.up import run

    args = build_parser().parse_args(["up", "--planner", "slo", "--ttft-slo", "2", "--tpot-slo", "-1"])
    assert run(args) == 2
    assert "--tpot-slo" in capsys.readouterr().err
