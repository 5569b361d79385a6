"""Inter-batch work stealing, including the paper's §3.4 example."""

from __future__ import annotations

import pytest

from pdserve.tdpipe.work_stealing import WorkStealer


def test_paper_section_3_4_example() -> None:
    stealer: WorkStealer[int] = WorkStealer(4)
    batches = stealer.start(list(range(512)))
    assert [len(b) for b in batches] == [128] * 4
    # Batch 0 returns with 48 finished: average (3*128 + 80) / 4 = 116; all 80 go back.
    assert stealer.average(80) == 116
    b0 = stealer.rebalance(batches[0][:80])
    assert len(b0) == 80 and not stealer.held
    # Batch 1 returns with 8 finished: average (128 + 128 + 80 + 120) / 4 = 114; steal 6.
    assert stealer.average(120) == 114
    b1 = stealer.rebalance(batches[1][:120])
    assert len(b1) == 114 and len(stealer.held) == 6
    # Batches 2 and 3: nothing finished, each gives 14 to the held pool.
    assert len(stealer.rebalance(batches[2])) == 114
    assert len(stealer.rebalance(batches[3])) == 114
    assert len(stealer.held) == 34
    # Next round: batch 0 (80, none finished) is topped up with the stolen 34.
    b0 = stealer.rebalance(b0)
    assert len(b0) == 114 and not stealer.held
    assert sorted(b0 + b1 + batches[2][:114] + batches[3][:114])  # all distinct requests
    assert len(set(b0) | set(b1) | set(batches[2][:114]) | set(batches[3][:114])) == 456


def test_disabled_never_holds_back() -> None:
    stealer: WorkStealer[int] = WorkStealer(4, enabled=False)
    batches = stealer.start(list(range(512)))
    assert len(stealer.rebalance(batches[0][:10])) == 10
    assert len(stealer.rebalance(batches[1])) == 128
    assert not stealer.held


def test_no_request_lost_over_many_rounds() -> None:
    stealer: WorkStealer[int] = WorkStealer(3)
    batches = stealer.start(list(range(300)))
    alive = set(range(300))
    inflight = list(batches)
    for round_ in range(40):
        batch = inflight.pop(0)
        remaining = [r for r in batch if (r + round_) % 7]  # some finish each round
        alive -= set(batch) - set(remaining)
        inflight.append(stealer.rebalance(remaining))
        sizes = [len(b) for b in inflight]
    assert set().union(*map(set, inflight), stealer.held) == alive
    assert max(sizes) - min(sizes) <= max(2, len(alive) // 10)


def test_bad_stage_count() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        WorkStealer(0)


def test_resize_balances_more_batches_than_stages() -> None:
    stealer: WorkStealer[int] = WorkStealer(2)
    stealer.resize(3)
    assert [len(b) for b in stealer.start(list(range(9)))] == [3, 3, 3]
    assert stealer.average(3) == 3  # (3 + 3 + 3) / 3
    with pytest.raises(ValueError):
        stealer.resize(0)
