"""A decode instance's runs of steps (planner/instances.py): one event per run must give the same
times as stepping one token at a time, with and without a KV slope in the profile."""

from __future__ import annotations

import random

import pytest
from planner_helpers import linear_table

from pdserve.planner.instances import DecodeInstance, EventLoop, Run, SimRequest
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.overheads import PipelineOverheads


def sloped(kv_ms: float, context: int) -> CostTable:
    base = linear_table()
    return CostTable(
        "sloped", base.tokens, base.times_ms, PipelineOverheads(decode_context=context, decode_kv_ms=(kv_ms,))
    )


def step_by_step(table: CostTable, arrivals: list[tuple[float, int, int]]) -> list[float]:
    """The reference: one step at a time; a request that arrives during a step joins after it."""
    over = table.overheads
    kv_ms = over.decode_kv_ms[0] if over.decode_kv_ms else 0.0
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    running: dict[int, int] = {}  # request -> decode tokens made
    finish = [0.0] * len(arrivals)
    now = 0.0
    while pending or running:
        if not running:
            now = max(now, arrivals[pending[0]][0])
        while pending and arrivals[pending[0]][0] <= now:
            running[pending.pop(0)] = 0
        batch = len(running)
        kv = sum(arrivals[i][1] + 1 + made for i, made in running.items())
        table_ms = table.forward_ms(batch)
        now += max(0.1 * table_ms, table_ms + kv_ms * (kv - batch * over.decode_context)) / 1000
        for i in list(running):
            running[i] += 1
            if running[i] == arrivals[i][2] - 1:
                finish[i] = now
                del running[i]
    return finish


def by_runs(table: CostTable, arrivals: list[tuple[float, int, int]]) -> list[float]:
    loop = EventLoop()
    inst = DecodeInstance(loop, table, 10**9, 2048, colocated=False, on_finish=lambda r, t: None)
    reqs = [SimRequest(t, i, o, first_token=t) for t, i, o in arrivals]
    for req in reqs:
        loop.at(req.arrival, lambda now, req=req: inst.submit(req, now))
    loop.run()
    return [r.finish for r in reqs]


@pytest.mark.parametrize("table", [linear_table(), sloped(0.01, 200), sloped(0.05, 50)], ids=["flat", "slope", "steep"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runs_of_steps_match_stepping_one_token_at_a_time(table: CostTable, seed: int) -> None:
    rng = random.Random(seed)
    arrivals = [(rng.uniform(0, 3), rng.randint(10, 400), rng.randint(2, 60)) for _ in range(25)]
    assert by_runs(table, arrivals) == pytest.approx(step_by_step(table, arrivals), rel=1e-9, abs=1e-9)


def test_one_request_pays_the_kv_it_reads_beyond_the_profiled_context() -> None:
    table = sloped(0.01, 100)
    (finish,) = by_runs(table, [(0.0, 100, 5)])
    # 4 decode steps reading 101, 102, 103, 104 KV tokens: 1 + 2 + 3 + 4 tokens beyond the context
    assert finish == pytest.approx((4 * table.forward_ms(1) + 0.01 * 10) / 1000)


def test_a_run_finds_the_step_under_way() -> None:
    run = Run(start=1.0, first_s=0.5, growth_s=0.1, steps=10)
    assert [run.end(n) for n in (1, 2, 3)] == pytest.approx([1.5, 2.1, 2.8])
    assert run.steps_by(1.2) == 1 and run.steps_by(1.5) == 1 and run.steps_by(1.6) == 2 and run.steps_by(2.79) == 3
    assert Run(0.0, 0.25, 0.0, 4).steps_by(0.5) == 2 and Run(0.0, 0.25, 0.0, 4).steps_by(0.0) == 1
