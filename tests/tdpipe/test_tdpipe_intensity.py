"""Spatial-temporal intensity on hand-computed cases, and the controller's use of it."""

from __future__ import annotations

from collections import deque

import pytest

from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.intensity import decide, phase_peak_batch_size, spatial_intensity, temporal_intensity
from pdserve.tdpipe.memory_sim import FutureMemory
from pdserve.tdpipe.td_scheduler import TDPipeScheduler
from pdserve.tdpipe.work_stealing import WorkStealer
from pdserve.tdpipe.workload import SimRequest

# Forward time 10 ms up to 4 tokens, then 2.5 ms per token: peak per-request
# throughput is reached at 4 (4/10) and stays there (8/20).
TABLE = CostTable("hand", (1, 4, 8), (10.0, 10.0, 20.0))


def test_spatial_intensity() -> None:
    assert spatial_intensity(TABLE, 1, ref_batch_size=4) == pytest.approx(0.25)
    assert spatial_intensity(TABLE, 2, ref_batch_size=4) == pytest.approx(0.5)
    assert spatial_intensity(TABLE, 8, ref_batch_size=4) == pytest.approx(1.0)
    assert spatial_intensity(TABLE, 0, ref_batch_size=4) == 0.0


def test_temporal_intensity() -> None:
    # Two stages; prefills of 30 and 10 ms, decode step 10 ms:
    # bubble = (30 - 10) + 1 * 30 = 50; total = 40 + 2*10 + 50 = 110.
    assert temporal_intensity([30.0, 10.0], 10.0, 2) == pytest.approx(1 - 50 / 110)
    # One stage, prefill no longer than decode: no bubble at all.
    assert temporal_intensity([5.0, 5.0], 10.0, 1) == pytest.approx(1.0)
    assert temporal_intensity([], 10.0, 4) == 0.0


def test_decide_switches_only_when_spatial_below_temporal() -> None:
    lots_of_prefill = [5.0] * 20  # 1 stage: bubble 0, temporal 1
    assert decide(TABLE, 2, lots_of_prefill, 10.0, 1, ref_batch_size=4).switch_to_prefill
    assert not decide(TABLE, 4, lots_of_prefill, 10.0, 1, ref_batch_size=4).switch_to_prefill
    # Batch size 2 (spatial 0.5) against temporal 1 - 50/110 = 0.545: switch.
    d = decide(TABLE, 2, [30.0, 10.0], 10.0, 2, ref_batch_size=4)
    assert d.spatial == pytest.approx(0.5) and d.switch_to_prefill
    # Batch size 3 (spatial 0.75) stays in decode.
    assert not decide(TABLE, 3, [30.0, 10.0], 10.0, 2, ref_batch_size=4).switch_to_prefill


def test_temporal_intensity_without_refill_is_the_papers_bubble() -> None:
    # bubble = 30 - 10 = 20 only; total = 40 + 2*10 + 20 = 80.
    assert temporal_intensity([30.0, 10.0], 10.0, 2, refill=False) == pytest.approx(1 - 20 / 80)


def test_phase_peak_batch_size() -> None:
    assert phase_peak_batch_size(100, 0.0) == 100
    assert phase_peak_batch_size(100, 0.5) == 200
    assert phase_peak_batch_size(90, 0.1) == 100
    assert phase_peak_batch_size(0, 0.3) == 1 and phase_peak_batch_size(7, 1.0) == 7


# Forward time flat (40 ms) up to 256 tokens, then rising to 320 ms at 2048: per-request
# decode throughput is proportional to the batch size up to 256, as on the L20 tables.
FLAT = CostTable("flat", (1, 256, 2048), (40.0, 40.0, 320.0))


def test_decide_with_phase_peak_measures_the_loss_a_switch_can_recover() -> None:
    pending = [78.125] * 4  # four 2000-token prefills on 4 stages
    # The paper's peak (256) is out of reach when the KV capacity holds ~111 per batch.
    before = decide(FLAT, 100, pending, 10.0, 4, ref_batch_size=256)
    assert before.spatial == pytest.approx(100 / 256) and before.switch_to_prefill
    after = decide(FLAT, 100, pending, 10.0, 4, ref_batch_size=256, phase_done_ratio=0.1)
    assert after.spatial == pytest.approx(100 / 111) and not after.switch_to_prefill
    # Half the phase done: the batch is half what a refill restores, so switch.
    assert decide(FLAT, 100, pending, 10.0, 4, ref_batch_size=256, phase_done_ratio=0.5).switch_to_prefill
    # The cap still applies: a phase that started above 256 per batch is measured against 256.
    assert decide(FLAT, 200, pending, 10.0, 4, ref_batch_size=256, phase_done_ratio=0.5).spatial == pytest.approx(
        200 / 256
    )


def _decision_at(opts: TDPipeOptions, done_ratio: float) -> bool:
    """`_should_prefill` with 4 batches of 100 resident and 40 prompts of 200 tokens waiting."""
    inst = InstanceConfig(num_stages=4, capacity_blocks=100_000)
    sched = TDPipeScheduler(FLAT, inst, opts)
    stealer: WorkStealer[SimRequest] = WorkStealer(4)
    residents = [SimRequest(i, 200, 500, 500, num_generated=10) for i in range(400)]
    stealer.start(residents)
    waiting = deque(SimRequest(1000 + i, 200, 50, 50) for i in range(40))
    return sched._should_prefill(stealer, residents[:100], waiting, done_ratio, FutureMemory(sched.future), 10)


def test_td_scheduler_does_not_switch_after_a_tenth_of_the_phase() -> None:
    """The old rule (peak at 256) switched here: spatial 0.39 < temporal 0.54, with only
    10% of the phase's requests finished; on the L20 tables that meant a phase switch
    every ~2 s and 17% bubble (benchmarks/tdpipe_intensity.py)."""
    # whole prompts, as in that study: chunked ones (the default) shrink the pending phase's refill
    # from a 400-token batch to a 256-token one, which makes this borderline switch pay
    whole = {"chunk_prefills": False}
    assert _decision_at(TDPipeOptions(spatial_peak="fixed", **whole), 0.1)
    assert not _decision_at(TDPipeOptions(**whole), 0.1)
    assert _decision_at(TDPipeOptions(**whole), 0.5)


def test_spatial_peak_option_is_validated() -> None:
    with pytest.raises(ValueError, match="spatial_peak"):
        TDPipeOptions(spatial_peak="sometimes")  # type: ignore[arg-type]
