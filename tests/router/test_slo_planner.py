"""The SLO planner's decision core (router/slo_planner.py), driven by observations made up here: a
small plant whose pressure is its load over its node count, with noise, stands in for a cluster."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.router.slo_planner import (
    Observation,
    PlannerConfig,
    SloPlanner,
    pressure,
    quantile_with_misses,
)

TTFT, TPOT = 2.0, 0.1
INTERVAL, DWELL = 10.0, 60.0


def config(**kw) -> PlannerConfig:
    base = dict(planner="slo", ttft_slo=TTFT, tpot_slo=TPOT, planner_interval=INTERVAL, planner_dwell=DWELL)
    return PlannerConfig(**{**base, **kw})


def planner(num_prefill: int = 1, num_decode: int = 1, max_nodes: int = 6, **kw) -> SloPlanner:
    return SloPlanner(config(**kw), num_prefill, num_decode, max_nodes)


def plant(now: float, p: SloPlanner, prefill_load: float, decode_load: float, rng: random.Random) -> Observation:
    """What a cluster of `p`'s current counts would show under a steady load: 40 finished requests
    whose TTFT and TPOT are the role's load over its node count (in SLOs), +-8% noise each."""
    ttft = prefill_load / max(p.num_prefill, 1) * TTFT
    tpot = decode_load / p.num_decode * TPOT
    return Observation(
        now=now,
        num_prefill=p.num_prefill,
        num_decode=p.num_decode,
        ttfts=[ttft * rng.uniform(0.92, 1.08) for _ in range(40)],
        tpots=[tpot * rng.uniform(0.92, 1.08) for _ in range(40)],
        kv_usage=0.3,
    )


def run(p: SloPlanner, prefill_load: float, decode_load: float, intervals: int = 300) -> list[tuple[int, int]]:
    """The counts at the start and after every decision."""
    rng = random.Random(51)
    shapes = [(p.num_prefill, p.num_decode)]
    for i in range(intervals):
        p.decide(plant(i * INTERVAL, p, prefill_load, decode_load, rng))
        shapes.append((p.num_prefill, p.num_decode))
    return shapes


def changes(shapes: list[tuple[int, int]]) -> int:
    return sum(1 for a, b in zip(shapes, shapes[1:]) if a != b)


@pytest.mark.parametrize(
    "decode_load,start,settled",
    [
        # 2 decode nodes sit right at the SLO (pressure 1.0 +- noise, its 90th percentile just over the
        # upper threshold): it grows to 3 (pressure 0.67) and never goes back
        (2.0, 2, 3),
        # 3 decode nodes sit right at the lower threshold (0.47 +- noise, its 90th percentile near
        # 0.5): it shrinks to 2 (0.7) and stays
        (1.4, 3, 2),
    ],
)
def test_steady_load_at_the_boundary_between_two_shapes_does_not_oscillate(decode_load, start, settled):
    p = planner(num_prefill=1, num_decode=start)
    shapes = run(p, prefill_load=0.7, decode_load=decode_load)
    assert shapes[-1] == (1, settled)
    assert changes(shapes) == 1, shapes[:20]


def test_without_the_band_the_same_load_would_oscillate():
    """The test above can fail: with both thresholds at the SLO a steady load flips between two sizes."""
    p = planner(num_prefill=1, num_decode=2, scale_down_pressure=0.999)
    p._has_slack = lambda role, value, up, pr: p.count(role) > p.least(role) and value < 0.999  # type: ignore[method-assign]
    assert changes(run(p, prefill_load=0.7, decode_load=1.6)) > 10


def test_a_burst_behind_backpressure_still_scales_up():
    """The few requests that finished met the TTFT SLO; the burst waits in the admission queue or
    was refused, so it has no TTFT of its own: the planner must still see it."""
    p = planner(num_prefill=1, num_decode=2, max_nodes=6)
    obs = Observation(
        now=0.0,
        num_prefill=1,
        num_decode=2,
        ttfts=[0.2 * TTFT] * 3,
        tpots=[0.3 * TPOT] * 3,
        waiting=[0.1 * i for i in range(40)],
        refused=30,
        kv_usage=0.2,
        prefill_backlog=25.0,
    )
    assert pressure(obs, p.config).prefill > 1.0
    decision = p.decide(obs)
    assert decision.action == "add_prefill" and (p.num_prefill, p.num_decode) == (2, 2)
    # judged on the finished requests alone the same window looks idle
    assert pressure(Observation(0.0, 1, 2, ttfts=obs.ttfts, tpots=obs.tpots), p.config).prefill < 0.5


def test_waiting_requests_count_with_their_wait_so_far():
    obs = Observation(0.0, 1, 1, ttfts=[0.1] * 5, waiting=[3 * TTFT] * 5)
    assert pressure(obs, config()).prefill == pytest.approx(3.0)


def test_a_burst_at_the_budget_takes_a_node_from_the_role_with_slack():
    p = planner(num_prefill=1, num_decode=3, max_nodes=4)
    obs = Observation(0.0, 1, 3, ttfts=[0.5] * 5, tpots=[0.2 * TPOT] * 5, refused=20, prefill_backlog=30.0)
    decision = p.decide(obs)
    assert decision.action == "move_to_prefill" and (p.num_prefill, p.num_decode) == (2, 2)


def test_at_the_budget_no_node_moves_from_a_role_without_slack():
    p = planner(num_prefill=1, num_decode=3, max_nodes=4)
    # decode at 0.8: with one node fewer it would be at 1.2, over its SLO
    obs = Observation(0.0, 1, 3, ttfts=[3 * TTFT] * 5, tpots=[0.8 * TPOT] * 5, prefill_backlog=10.0)
    assert p.decide(obs).action == "hold" and (p.num_prefill, p.num_decode) == (1, 3)


def test_dwell_time_is_respected_after_every_change():
    p = planner(num_prefill=1, num_decode=1, max_nodes=10)
    hot = dict(ttfts=[0.1] * 5, tpots=[3 * TPOT] * 5)
    times = []
    for i in range(40):
        now = i * INTERVAL
        if p.decide(Observation(now, p.num_prefill, p.num_decode, **hot)).action != "hold":
            times.append(now)
    assert len(times) >= 3
    assert all(b - a >= DWELL for a, b in zip(times, times[1:])), times


@pytest.mark.parametrize("max_nodes,min_prefill", [(2, 1), (3, 0), (5, 1)])
def test_the_budget_and_the_minimums_hold_under_any_pressure(max_nodes, min_prefill):
    rng = random.Random(7)
    p = planner(num_prefill=1, num_decode=1, max_nodes=max_nodes, planner_min_prefill=min_prefill, planner_dwell=0)
    for i in range(400):
        swing = rng.choice([0.0, 0.2, 5.0])
        obs = Observation(
            i * INTERVAL,
            p.num_prefill,
            p.num_decode,
            ttfts=[rng.uniform(0, 3) * TTFT * swing] * 5,
            tpots=[rng.uniform(0, 3) * TPOT * swing] * 5,
            refused=rng.choice([0, 0, 10]),
            kv_usage=rng.random(),
        )
        p.decide(obs)
        assert p.num_prefill + p.num_decode <= max_nodes
        assert p.num_decode >= 1 and p.num_prefill >= min_prefill


def test_which_role_is_short():
    c = config()
    # TTFT misses with a prefill backlog: prefill
    assert pressure(Observation(0, 1, 1, ttfts=[2 * TTFT] * 5, prefill_backlog=8.0), c).prefill == pytest.approx(2.0)
    # TPOT misses: decode
    assert pressure(Observation(0, 1, 1, tpots=[1.5 * TPOT] * 5), c) == pytest.approx((0.0, 1.5))
    # decode KV full and no prompt work pending: the TTFT misses are decode's
    p = pressure(Observation(0, 1, 1, ttfts=[3 * TTFT] * 5, kv_usage=0.95), c)
    assert p.decode == pytest.approx(3.0) and p.prefill == 0.0
    # both short: the worse one gets the node
    both = Observation(0, 1, 1, ttfts=[3 * TTFT] * 5, tpots=[1.5 * TPOT] * 5, prefill_backlog=5.0)
    assert planner().decide(both).action == "add_prefill"
    both = Observation(0, 1, 1, ttfts=[1.5 * TTFT] * 5, tpots=[3 * TPOT] * 5, prefill_backlog=5.0)
    assert planner().decide(both).action == "add_decode"


def test_an_idle_cluster_shrinks_to_its_minimum_one_node_at_a_time():
    p = planner(num_prefill=2, num_decode=3, max_nodes=6, planner_dwell=0)
    shapes = [(p.decide(Observation(i * INTERVAL, 0, 0)).num_prefill, p.num_decode) for i in range(10)]
    assert shapes[-1] == (1, 1)
    assert changes([(2, 3), *shapes]) == 3


def test_at_its_minimum_nodes_an_idle_cluster_keeps_them_and_moves_a_node_when_a_role_is_short():
    p = planner(num_prefill=1, num_decode=2, max_nodes=3, planner_dwell=0, planner_min_nodes=3)
    decision = p.decide(Observation(0.0, 1, 2))
    assert (decision.action, decision.reason) == ("hold", "at --planner-min-nodes")
    busy = Observation(10.0, 1, 2, ttfts=[2 * TTFT] * 10, tpots=[0.2 * TPOT] * 10, prefill_backlog=2 * TTFT)
    assert p.decide(busy).action == "move_to_prefill"
    assert (p.num_prefill, p.num_decode) == (2, 1)
    p = planner(num_prefill=1, num_decode=3, max_nodes=4, planner_dwell=0, planner_min_nodes=3)
    assert p.decide(Observation(0.0, 1, 3)).action == "remove_decode"  # above the minimum: shrinks to it
    assert p.decide(Observation(10.0, 1, 2)).action == "hold"


def test_quantile_counts_refusals_as_misses():
    assert quantile_with_misses([1.0] * 9, 1, 0.9) == 1.0
    assert quantile_with_misses([1.0] * 8, 2, 0.9) == math.inf
    assert quantile_with_misses([], 0, 0.9) == 0.0


def test_existing_counts_outside_the_budget_start_inside_it():
    p = planner(num_prefill=4, num_decode=4, max_nodes=5)
    assert p.num_prefill + p.num_decode == 5 and p.num_decode == 4


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(ttft_slo=0.0), "--ttft-slo"),
        (dict(tpot_slo=-1.0), "--tpot-slo"),
        (dict(ttft_slo=None), "--ttft-slo"),
        (dict(tpot_slo=None), "--tpot-slo"),
        (dict(planner="magic"), "--planner"),
        (dict(planner_interval=0.0), "--planner-interval"),
        (dict(planner_window=5.0), "--planner-window"),
        (dict(planner_dwell=-1.0), "--planner-dwell"),
        (dict(planner_max_nodes=1), "--planner-max-nodes"),
        (dict(planner_min_prefill=2), "--planner-min-prefill"),
        (dict(planner_min_nodes=1), "--planner-min-nodes"),
        (dict(planner_min_nodes=4, planner_max_nodes=3), "--planner-min-nodes"),
    ],
)
def test_bad_config_is_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        config(**kw)


def test_a_budget_below_one_prefill_and_one_decode_node_is_refused():
    with pytest.raises(ValueError, match="--planner-max-nodes"):
        SloPlanner(config(), 1, 1, max_nodes=1)
    with pytest.raises(ValueError, match="--planner-max-nodes"):
        config(planner_max_nodes=1, planner_min_prefill=0)


def test_planner_off_needs_no_slos():
    assert not PlannerConfig().enabled


@pytest.mark.parametrize("decode_prefills, action", [(True, "hold"), (False, "remove_decode")])
def test_a_decode_node_that_takes_offloaded_prompts_is_not_removed_while_prefill_is_busy(decode_prefills, action):
    """Decode's own pressure is low (TPOT 0.2x), prefill's moderate (0.7x, inside the band): with the
    router's offload on, the decode nodes prefill part of the prompts, so neither role is idle."""
    p = planner(num_prefill=1, num_decode=2, max_nodes=3)
    obs = Observation(
        0.0, 1, 2, ttfts=[0.7 * TTFT] * 5, tpots=[0.2 * TPOT] * 5, prefill_backlog=1.0, decode_prefills=decode_prefills
    )
    assert p.decide(obs).action == action
    idle = Observation(10.0, 1, 2, ttfts=[0.1 * TTFT] * 5, tpots=[0.2 * TPOT] * 5, decode_prefills=True)
    assert planner(num_prefill=1, num_decode=2, max_nodes=3).decide(idle).action == "remove_decode"
