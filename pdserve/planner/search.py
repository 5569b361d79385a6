"""The search: every shape within a budget, each with a binary search on the arrival rate.

For each shape the goodput is the highest rate at which at least the target share of requests
meets both SLOs (DistServe's definition), found by doubling or halving from an estimate of the
shape's capacity until the target is bracketed, then bisecting in log space. Shapes are ranked by
goodput per unit (GPU or core), as DistServe compares placements; ties go to the higher total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from pdserve.planner.cluster import Shape, attainment
from pdserve.planner.config import SLO, SimConfig
from pdserve.planner.profile import Profile
from pdserve.planner.workload import Workload

FLOOR_RATIO = 1 / 1024
"""The lowest rate searched, relative to the capacity estimate: far below it requests never queue."""
BISECTIONS = 6
"""Bisection steps in log space after bracketing by a factor 2: about 1% precision."""
MAX_DOUBLINGS = 20
CONCURRENCY_FACTOR = 4
"""A shape is simulated on at least this many times the requests its KV holds at once, and over
arrivals spanning at least `HORIZON` lifetimes of a mean request alone: fewer, and a rate far above
its throughput only shows a burst it absorbs (a long output even hides a long wait for decode
room in its mean TPOT), never the queue that builds."""
HORIZON = 8
MIN_REQUESTS = 2000
"""...and on at least this many: a near-saturated queue's 90th percentile converges slowly, and at
~150 requests the bench model's predicted goodput moved by up to 40% with the arrivals' seed (at
2,000, by under 10%)."""
MAX_REQUESTS = 20000
"""...but never more than this many requests per simulation (its time)."""


class Goodput(NamedTuple):
    """The result of one shape's rate search."""

    rate: float
    """Highest rate found with attainment >= the target (0: none, down to `floor_rate`)."""
    attainment: float
    """Attainment at `rate` (at `floor_rate` when `rate` is 0)."""
    floor_rate: float
    """The lowest rate the search would try."""
    bounded: bool
    """False when even the highest rate tried met the target: the workload's requests then all
    arrive nearly at once and goodput is more than they can show (use more requests)."""


def search_rate(attain: Callable[[float], float], target: float, start: float) -> Goodput:
    """Binary search for the highest rate with `attain(rate) >= target`, assuming attainment falls
    as the rate grows (the same requests, arrivals only scaled, make that nearly exact)."""
    assert start > 0, "the search starts at a positive rate"
    floor = start * FLOOR_RATIO
    rate, got = start, attain(start)
    if got >= target:
        lo, lo_att, hi = rate, got, 0.0
        for _ in range(MAX_DOUBLINGS):
            att = attain(lo * 2)
            if att < target:
                hi = lo * 2
                break
            lo, lo_att = lo * 2, att
        if hi == 0.0:
            return Goodput(lo, lo_att, floor, False)
    else:
        hi = rate
        while True:
            rate /= 2
            if rate < floor:
                return Goodput(0.0, attain(floor), floor, True)
            got = attain(rate)
            if got >= target:
                lo, lo_att = rate, got
                break
            hi = rate
    for _ in range(BISECTIONS):
        mid = (lo * hi) ** 0.5
        att = attain(mid)
        if att >= target:
            lo, lo_att = mid, att
        else:
            hi = mid
    return Goodput(lo, lo_att, floor, True)


@dataclass(frozen=True)
class Budget:
    """What the shapes may take: `nodes` nodes of `per_node` GPUs (or one node of `per_node` cores);
    an instance lives on one node."""

    per_node: int
    nodes: int
    degrees: tuple[int, ...]
    """Degrees an instance may have (GPUs: powers of two up to the GPUs of one node)."""

    def __post_init__(self) -> None:
        if self.units < 2:
            raise ValueError(f"{self.units} unit(s) cannot hold one prefill and one decode instance")
        assert self.degrees and max(self.degrees) <= self.per_node, f"degrees beyond the node: {self}"

    @property
    def units(self) -> int:
        return self.per_node * self.nodes

    def fits(self, shape: Shape) -> bool:
        """Whether the shape's instances pack onto the nodes (first fit, largest first: exact for
        degrees that are powers of two on nodes of a power of two, and a sound check otherwise)."""
        degrees = [shape.prefill_degree] * shape.num_prefill + [shape.decode_degree] * shape.num_decode
        free = [self.per_node] * self.nodes
        for d in sorted(degrees, reverse=True):
            node = next((i for i, f in enumerate(free) if f >= d), None)
            if node is None:
                return False
            free[node] -= d
        return True


def powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(2**k for k in range(limit.bit_length()) if 2**k <= limit)


def shapes(budget: Budget) -> list[Shape]:
    """Every disaggregated shape (P >= 1, D >= 1) and every colocated one that takes more than half
    the budget: a smaller one fits twice, and is searched as its double (the same per-unit
    goodput or better, since one router then balances both halves)."""
    found = []
    for dd in budget.degrees:
        for num_decode in range(1, budget.units // dd + 1):
            found.append(Shape(0, 0, num_decode, dd))
            for dp in budget.degrees:
                left = budget.units - num_decode * dd
                found.extend(Shape(p, dp, num_decode, dd) for p in range(1, left // dp + 1))
    return [s for s in found if 2 * s.units > budget.units and budget.fits(s)]


class Ranked(NamedTuple):
    """One shape's predicted goodput (modelled), and whether its tables were all profiled."""

    shape: Shape
    goodput: Goodput
    profiled: bool
    """Every degree of the shape has a table in the profile (else some are Amdahl-scaled: modelled)."""

    @property
    def per_unit(self) -> float:
        return self.goodput.rate / self.shape.units


def capacity_estimate(shape: Shape, profile: Profile, workload: Workload, config: SimConfig) -> float:
    """Requests/s the shape could take with full batches on both sides: the search's first rate."""
    frac, mean_in, mean_out = config.parallel_fraction, workload.mean_input, workload.mean_output
    decode = profile.table(shape.decode_degree, frac)
    batch = max(1, min(config.max_batch_tokens, round(config.kv_tokens / (mean_in + mean_out))))
    decode_rate = shape.num_decode * batch / (decode.forward_ms(batch) / 1000.0) / max(1.0, mean_out - 1)
    if shape.colocated:
        prefill, count = decode, shape.num_decode
    else:
        prefill, count = profile.table(shape.prefill_degree, frac), shape.num_prefill
    tokens_per_s = config.max_batch_tokens / (prefill.forward_ms(config.max_batch_tokens) / 1000.0)
    return min(count * tokens_per_s / mean_in, decode_rate)


def attainment_at(
    shape: Shape, profile: Profile, workload: Workload, slo: SLO, config: SimConfig, cores: int = 0
) -> Callable[..., float]:
    """The shape's attainment as a function of the rate (what `search_rate` searches); `exact=True`
    runs every request (`cluster.attainment`). `cores`: the core budget the shape shares with the
    other processes (`SimConfig.host_cpu_ms_per_request`); 0: a GPU budget, nothing shared."""
    frac = config.parallel_fraction
    prefill = None if shape.colocated else profile.table(shape.prefill_degree, frac)
    decode = profile.table(shape.decode_degree, frac)
    mean_in, mean_out = round(workload.mean_input), round(workload.mean_output)
    resident = shape.num_decode * config.kv_tokens / (mean_in + mean_out)
    lifetime_s = ((prefill or decode).forward_ms(mean_in) + (mean_out - 1) * decode.forward_ms(1)) / 1000.0
    workload = workload.at_least(min(MAX_REQUESTS, max(MIN_REQUESTS, round(CONCURRENCY_FACTOR * resident))))

    def attain(rate: float, exact: bool = False) -> float:
        slow = config.host_slowdown(rate, shape.units, cores) if cores else 1.0
        if slow is None:
            return 0.0
        tables = (prefill, decode)
        if slow > 1.0:
            tables = (prefill and prefill.scaled(slow, prefill.name), decode.scaled(slow, decode.name))
        run = workload.at_least(min(MAX_REQUESTS, math.ceil(rate * HORIZON * lifetime_s)))
        return attainment(shape, tables, list(run.requests), run.arrivals(rate), slo, config, exact)

    return attain


def evaluate(shape: Shape, profile: Profile, workload: Workload, slo: SLO, config: SimConfig, cores: int = 0) -> Ranked:
    """One shape's goodput by simulation and binary search (`cores`: as `attainment_at`'s)."""
    attain = attainment_at(shape, profile, workload, slo, config, cores)
    result = search_rate(attain, slo.attainment, capacity_estimate(shape, profile, workload, config))
    if result.rate == 0:  # the search stopped counting at the target; the closest shape needs the whole count
        result = result._replace(attainment=attain(result.floor_rate, exact=True))
    degrees = [shape.decode_degree] + ([] if shape.colocated else [shape.prefill_degree])
    return Ranked(shape, result, all(profile.is_profiled(d) for d in degrees))


def rank(results: list[Ranked]) -> list[Ranked]:
    """Best first: goodput per unit, then total goodput, then attainment, then fewer units."""
    return sorted(
        results, key=lambda r: (-r.per_unit, -r.goodput.rate, -r.goodput.attainment, r.shape.units, r.shape.label(""))
    )


def plan(profile: Profile, workload: Workload, slo: SLO, budget: Budget, config: SimConfig) -> list[Ranked]:
    """Every shape of the budget, ranked (the first is the recommendation when its goodput is > 0)."""
    cores = budget.units if profile.unit == "core" else 0
    return rank([evaluate(s, profile, workload, slo, config, cores) for s in shapes(budget)])


def closest(results: list[Ranked]) -> Ranked:
    """When no shape meets the SLOs: the one with the highest attainment at the lowest rate searched."""
    return max(results, key=lambda r: (r.goodput.attainment, -r.shape.units))
