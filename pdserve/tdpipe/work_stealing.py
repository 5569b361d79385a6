"""Inter-batch work stealing: keep the decode batches in flight equal in size."""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class WorkStealer(Generic[T]):
    """Balances `num_stages` decode batches with a sliding window (paper §3.4).

    The window holds the sizes submitted for the last `num_stages` batches. When a
    batch returns, its own (oldest) entry leaves the window, its finished requests
    are removed, and the average is (other batches in flight + this batch + held
    back) / num_stages. A batch above the average gives its excess to the held-back
    pool; a batch below it is topped up from that pool.
    """

    def __init__(self, num_stages: int, enabled: bool = True) -> None:
        if num_stages <= 0:
            raise ValueError(f"num_stages must be > 0, got {num_stages}")
        self.num_stages = num_stages
        self.enabled = enabled
        self.window: deque[int] = deque(maxlen=num_stages)
        self.held: list[T] = []

    def resize(self, num_batches: int) -> None:
        """Balance `num_batches` batches from now on (more than the stages hides a round trip)."""
        if num_batches <= 0:
            raise ValueError(f"num_batches must be > 0, got {num_batches}")
        self.num_stages = num_batches
        self.window = deque(self.window, maxlen=num_batches)

    def start(self, requests: list[T]) -> list[list[T]]:
        """Split the decode-phase requests into `num_stages` batches of equal size."""
        self.window.clear()
        self.held = []
        batches = [requests[i :: self.num_stages] for i in range(self.num_stages)]
        for b in batches:
            self.window.append(len(b))
        return batches

    def average(self, num_remaining: int) -> int:
        """Target size for a batch that returned with `num_remaining` live requests."""
        others = sum(list(self.window)[1:]) if len(self.window) == self.num_stages else sum(self.window)
        total = others + num_remaining + len(self.held)
        return -(-total // self.num_stages)  # ceil, so the held pool always drains

    def rebalance(self, remaining: list[T]) -> list[T]:
        """Called with a returned batch's unfinished requests; returns what to submit."""
        if self.enabled:
            target = self.average(len(remaining))
            if len(remaining) > target:
                self.held.extend(remaining[target:])
                remaining = remaining[:target]
            elif len(remaining) < target and self.held:
                take = min(target - len(remaining), len(self.held))
                remaining = remaining + self.held[:take]
                del self.held[:take]
        self.window.append(len(remaining))  # maxlen drops the returned batch's entry
        return remaining

    def drain_held(self) -> list[T]:
        """Requests still held back (given back when the decode phase ends)."""
        held, self.held = self.held, []
        return held
