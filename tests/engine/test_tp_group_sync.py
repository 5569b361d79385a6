"""TPGroup.synchronize: on CUDA, NCCL's `work.wait()` does not block the host, so each all-reduce is
bracketed by events and the forward ends by waiting for the last one, bounded by the group's
timeout. Held here with stand-in events (no GPU on CI); the same code runs under `pytest -m gpu`."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.parallel.group import RankFailure, TPGroup, rendezvous


class Event:
    """A CUDA event's host-side surface: `query` (done yet?) and `elapsed_time` (ms, start to end)."""

    def __init__(self, done_at: float | None, at_ms: float = 0.0) -> None:
        self.done_at, self.at_ms = done_at, at_ms

    def query(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def elapsed_time(self, end: Event) -> float:
        return end.at_ms - self.at_ms


@pytest.fixture
def group():
    store = rendezvous(0, 1, 0, 30)
    return TPGroup(0, 1, store, torch.device("cpu"), timeout_s=0.3)


def test_a_completed_forward_counts_its_collectives_time(group):
    soon = time.monotonic() + 0.05
    group._events = [(Event(soon, 0.0), Event(soon, 3.0)), (Event(soon, 10.0), Event(soon, 14.0))]
    group.synchronize()
    assert group.all_reduce_seconds == pytest.approx(0.007)
    assert group._events == []
    group.synchronize()  # nothing pending: no wait, nothing counted twice
    assert group.all_reduce_seconds == pytest.approx(0.007)


def test_a_collective_that_never_completes_is_a_rank_failure_after_the_timeout(group):
    group._events = [(Event(0.0), Event(None))]  # a peer hung: the stream never gets past it
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="did not complete within 0.3 s"):
        group.synchronize()
    assert time.monotonic() - t0 >= 0.3


def test_gloo_collectives_take_the_configured_timeout(group):
    t = torch.ones(4)
    assert group.all_reduce(t) is t and torch.equal(t, torch.ones(4))  # one rank: the sum is itself
    assert group.agree_min(7) == 7
    assert group._events is None  # gloo's wait blocks and raises itself: nothing to synchronize
