"""The rate search and the shape enumeration (planner/search.py)."""

from __future__ import annotations

import pytest
from planner_helpers import config, linear_table

from pdserve.planner.cluster import Shape, attainment, simulate
from pdserve.planner.config import SLO
from pdserve.planner.profile import Profile
from pdserve.planner.search import Budget, attainment_at, evaluate, search_rate, shapes
from pdserve.planner.workload import from_lengths


def step(limit: float, high: float = 1.0, low: float = 0.5):
    calls: list[float] = []

    def attain(rate: float) -> float:
        calls.append(rate)
        return high if rate <= limit else low

    return attain, calls


@pytest.mark.parametrize("start", [0.01, 3.0, 500.0])
def test_the_search_finds_the_highest_rate_that_meets_the_target_from_above_or_below(start: float) -> None:
    attain, calls = step(3.7)
    found = search_rate(attain, 0.9, start)
    assert found.bounded and found.attainment == 1.0
    assert 3.7 * 0.985 < found.rate <= 3.7
    assert len(calls) < 40


def test_a_target_met_at_no_rate_gives_zero_and_the_attainment_at_the_lowest_rate() -> None:
    attain, calls = step(-1.0, low=0.4)
    found = search_rate(attain, 0.9, 2.0)
    assert found.rate == 0.0 and found.attainment == 0.4 and found.floor_rate == pytest.approx(2.0 / 1024)
    assert min(calls) == found.floor_rate


def test_a_target_met_at_every_rate_is_reported_unbounded() -> None:
    attain, _ = step(float("inf"))
    found = search_rate(attain, 0.9, 1.0)
    assert not found.bounded and found.rate >= 2**19


def test_simulated_attainment_falls_as_the_rate_rises() -> None:
    """What the binary search relies on: the same requests, arrivals only scaled."""
    work, table, slo = from_lengths(300, 30, 0.5, 80, seed=3), linear_table(), SLO(0.3, 0.03)
    shape = Shape(1, 1, 1, 1)
    got = []
    for rate in (0.5, 2.0, 8.0, 32.0, 128.0):
        outs = simulate(shape, table, table, list(work.requests), work.arrivals(rate), config())
        got.append(sum(slo.met(o.ttft, o.tpot) for o in outs) / len(outs))
    assert got == sorted(got, reverse=True) and got[0] == 1.0 and got[-1] < 0.5
    # the early-stopping count agrees on which side of the target a rate is
    early = [
        attainment(shape, (table, table), list(work.requests), work.arrivals(r), slo, config()) for r in (0.5, 128.0)
    ]
    assert early[0] == 1.0 and early[1] < slo.attainment


def test_a_found_goodput_meets_the_target_and_a_rate_3_percent_above_it_does_not() -> None:
    work, table = from_lengths(300, 30, 0.5, 80, seed=3), linear_table()
    profile = Profile("m", "hw", "gpu", {1: table})
    slo = SLO(0.3, 0.03)
    shape = Shape(1, 1, 1, 1)
    ranked = evaluate(shape, profile, work, slo, config())
    assert ranked.goodput.rate > 0 and ranked.goodput.attainment >= 0.9 and ranked.profiled
    attain = attainment_at(shape, profile, work, slo, config())
    assert attain(ranked.goodput.rate) >= 0.9 > attain(ranked.goodput.rate * 1.03)


def test_a_shape_that_never_meets_the_slos_reports_its_whole_attainment_at_the_lowest_rate() -> None:
    work, table = from_lengths(300, 30, 0.5, 80, seed=3), linear_table()
    profile = Profile("m", "hw", "gpu", {1: table})
    shape, slo = Shape(1, 1, 1, 1), SLO(0.05, 1.0)  # prompts of 150-450 tokens take 35-65 ms alone
    ranked = evaluate(shape, profile, work, slo, config())
    assert ranked.goodput.rate == 0
    assert ranked.goodput.attainment == attainment_at(shape, profile, work, slo, config())(
        ranked.goodput.floor_rate, exact=True
    )
    assert 0.2 < ranked.goodput.attainment < 0.8


def test_shapes_stay_within_the_budget_and_take_more_than_half_of_it() -> None:
    budget = Budget(4, 2, (1, 2, 4))  # two nodes of 4 GPUs
    found = shapes(budget)
    assert all(4 < s.units <= 8 for s in found)
    assert Shape(7, 1, 1, 1) in found and Shape(1, 4, 1, 4) in found and Shape(0, 0, 2, 4) in found
    assert Shape(1, 1, 1, 1) not in found  # it fits twice: searched as 2P:2D
    assert len(found) == len(set(found))


def test_an_instance_lives_on_one_node() -> None:
    budget = Budget(6, 2, (1, 2, 4))  # 12 GPUs, but a node holds one TP-4 instance and two GPUs more
    assert not budget.fits(Shape(2, 4, 1, 4)) and Shape(2, 4, 1, 4) not in shapes(budget)
    assert budget.fits(Shape(1, 4, 1, 4)) and budget.fits(Shape(2, 2, 1, 4)) and budget.fits(Shape(4, 1, 2, 4))


def test_a_budget_of_one_unit_is_refused() -> None:
    with pytest.raises(ValueError, match="one prefill and one decode"):
        Budget(1, 1, (1,))
    Budget(2, 1, (1, 2))  # two cores: 1P:1D


def test_host_processes_use_the_free_cores_first_then_slow_the_shapes_forwards() -> None:
    cfg = config(host_cpu_ms_per_request=100.0)  # 10 req/s: one core's worth
    assert cfg.host_slowdown(10.0, units=2, cores=3) == 1.0  # the spare core takes it
    assert cfg.host_slowdown(10.0, units=2, cores=2) == pytest.approx(2.0)  # half of each core is left
    assert cfg.host_slowdown(15.0, units=2, cores=2) == pytest.approx(4.0)
    assert cfg.host_slowdown(20.0, units=2, cores=2) is None  # they alone need both cores
    assert config().host_slowdown(1e6, units=2, cores=2) == 1.0


def test_a_host_cost_lowers_a_core_shapes_goodput_and_caps_it_where_the_host_needs_every_core() -> None:
    work, table = from_lengths(300, 30, 0.5, 80, seed=3), linear_table()
    profile = Profile("m", "hw", "core", {1: table})
    slo, shape = SLO(0.3, 0.03), Shape(1, 1, 1, 1)
    alone = evaluate(shape, profile, work, slo, config(), cores=2).goodput.rate
    shared = evaluate(shape, profile, work, slo, config(host_cpu_ms_per_request=20.0), cores=2)
    assert 0 < shared.goodput.rate < alone and shared.goodput.attainment >= 0.9
    # no rate at which the other processes alone need both cores can pass: here from alone / 4 on
    heavy = config(host_cpu_ms_per_request=2 * 1000.0 / (alone / 4))
    assert 0 < evaluate(shape, profile, work, slo, heavy, cores=2).goodput.rate < alone / 4
    # cores=0 (a GPU budget): the term is not applied
    assert evaluate(shape, profile, work, slo, config(host_cpu_ms_per_request=20.0)).goodput.rate == alone
