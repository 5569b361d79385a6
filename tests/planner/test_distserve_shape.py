"""On the published L20 tables, the planner reaches DistServe's qualitative result: more prefill
than decode instances for prefill-heavy loads (long prompts, short outputs), more decode than
prefill instances for long outputs."""

from __future__ import annotations

import pytest

from pdserve.planner.config import SLO, SimConfig
from pdserve.planner.profile import load_profile
from pdserve.planner.search import Budget, plan
from pdserve.planner.workload import from_lengths


@pytest.fixture(scope="module")
def llama13b():
    try:
        return load_profile("L20-Llama-13B")  # found by name: $PDSERVE_TDPIPE_TABLES, tdpipe/data/, ../shared/tdpipe/
    except ValueError:
        pytest.skip("the shared L20 tables are absent")


BUDGET = Budget(1, 4, (1,))  # four L20s, one GPU per instance: the measured degree only


def test_a_prefill_heavy_load_gets_more_prefill_than_decode_instances(llama13b) -> None:
    work = from_lengths(1536, 16, 0.5, 200, seed=0)
    ranked = plan(llama13b, work, SLO(1.0, 0.1), BUDGET, SimConfig())
    best = ranked[0].shape
    assert ranked[0].goodput.rate > 0 and best.num_prefill > best.num_decode, [r.shape for r in ranked[:3]]


def test_a_long_output_load_gets_more_decode_than_prefill_instances(llama13b) -> None:
    work = from_lengths(128, 512, 0.5, 200, seed=0)
    ranked = plan(llama13b, work, SLO(1.0, 0.06), BUDGET, SimConfig())
    best = ranked[0].shape
    assert ranked[0].goodput.rate > 0 and best.num_decode > best.num_prefill, [r.shape for r in ranked[:3]]
    # a colocated shape (0P:ND) satisfies that trivially: the best disaggregated one must too
    split = next(r.shape for r in ranked if not r.shape.colocated)
    assert split.num_decode > split.num_prefill, [r.shape for r in ranked[:3]]
