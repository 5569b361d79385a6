"""The live pipeline gauge metrics read while a batch job runs (tdpipe/runtime/live_stats.py)."""

from __future__ import annotations

import pytest

from pdserve.tdpipe.runtime import live_stats
from pdserve.tdpipe.runtime.live_stats import PipelineGauge


def test_bubble_is_the_share_of_stage_time_without_a_batch(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(live_stats.time, "monotonic", lambda: now[0])
    g = PipelineGauge(num_stages=2)
    assert g.bubble_fraction == 0.0 and g.phase == "starting"
    g.start()
    g.on_submit("prefill")  # t=0..1: one of two stages busy
    now[0] += 1.0
    g.on_submit("decode")  # t=1..3: both busy
    assert g.phase == "decode" and g.in_flight == 2
    now[0] += 2.0
    g.on_complete(3)
    g.on_complete(4)  # t=3..4: none in flight
    now[0] += 1.0
    # busy stage-time per stage: 0.5 + 2 = 2.5 of 4 s
    assert g.bubble_fraction == pytest.approx(1 - 2.5 / 4)
    assert g.output_tokens == 7 and g.batches_done == 2 and g.in_flight == 0
