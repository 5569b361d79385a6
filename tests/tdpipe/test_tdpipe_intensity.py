"""Spatial-temporal intensity on hand-computed cases."""

from __future__ import annotations

import pytest

from tdpipe.cost_table import CostTable
from tdpipe.intensity import decide, spatial_intensity, temporal_intensity

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
