"""AI-based greedy prefill: KV usage at future decode steps (the paper's Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_manager import blocks_for
from pdserve.tdpipe.config import require_positive


@dataclass(frozen=True)
class FuturePointsConfig:
    """Where to look ahead when deciding the prefill→decode switch."""

    capacity_blocks: int
    """KV blocks available to the pipeline instance."""
    block_size: int = 16
    """Tokens per KV block."""
    interval: int = 32
    """Distance in decode steps between futurePoints."""
    horizon: int = 1024
    """Last futurePoint (inclusive)."""

    def __post_init__(self) -> None:
        require_positive(self, "capacity_blocks", "block_size")
        if self.interval <= 0 or self.horizon < self.interval:
            raise ValueError(f"need 0 < interval <= horizon, got {self.interval}, {self.horizon}")

    @property
    def points(self) -> tuple[int, ...]:
        return tuple(range(self.interval, self.horizon + 1, self.interval))


def request_blocks_at(input_len: int, num_generated: int, predicted_len: int, step: int, block_size: int) -> int:
    """Blocks a request holds `step` decode steps from now (0 once it has finished).

    A request that has already reached its prediction is assumed to need one more
    step, so a wrong prediction never makes a live request vanish from the model.
    """
    remaining = max(predicted_len - num_generated, 1)
    if step > remaining:
        return 0
    return blocks_for(input_len + num_generated + step, block_size)


class FutureMemory:
    """KV blocks at each futurePoint for the resident requests, kept incrementally.

    Adding a request touches each futurePoint once, O(len(points)), instead of
    re-simulating every resident request (see `brute_force_usage`).
    """

    def __init__(self, config: FuturePointsConfig) -> None:
        self.config = config
        self.points = config.points
        self.usage = [0] * len(self.points)

    def _blocks(
        self, input_len: int, num_generated: int, predicted_len: int, offset: int, from_step: int
    ) -> list[tuple[int, int]]:
        """(point index, blocks) for a request that joins at step `offset`."""
        bs = self.config.block_size
        return [
            (i, request_blocks_at(input_len, num_generated, predicted_len, step - offset, bs))
            for i, step in enumerate(self.points)
            if step >= max(offset, from_step)
        ]

    def add(self, input_len: int, num_generated: int, predicted_len: int, offset: int = 0) -> None:
        """Account a request that is resident from decode step `offset` of this phase."""
        for i, blocks in self._blocks(input_len, num_generated, predicted_len, offset, 0):
            self.usage[i] += blocks

    def remove(
        self, input_len: int, num_generated: int, predicted_len: int, offset: int = 0, from_step: int = 0
    ) -> None:
        """Undo `add` for the points at or after `from_step` (the request finished early)."""
        for i, blocks in self._blocks(input_len, num_generated, predicted_len, offset, from_step):
            self.usage[i] -= blocks

    def would_overflow(self, input_len: int, num_generated: int, predicted_len: int, offset: int = 0) -> bool:
        """True when adding this request (at step `offset`) makes a futurePoint exceed capacity."""
        cap = self.config.capacity_blocks
        return any(
            self.usage[i] + blocks > cap
            for i, blocks in self._blocks(input_len, num_generated, predicted_len, offset, 0)
        )

    def overflows(self) -> bool:
        return any(u > self.config.capacity_blocks for u in self.usage)


def brute_force_usage(requests: list[tuple[int, int, int]], config: FuturePointsConfig) -> list[int]:
    """Reference: step every request through every decode step up to the horizon."""
    usage = []
    for step in config.points:
        total = 0
        for input_len, num_generated, predicted_len in requests:
            # Walk the request's life step by step, as a decode loop would.
            generated, blocks = num_generated, 0
            remaining = max(predicted_len - num_generated, 1)
            for s in range(1, step + 1):
                if s > remaining:
                    blocks = 0
                    break
                generated += 1
                blocks = blocks_for(input_len + generated, config.block_size)
            total += blocks
        usage.append(total)
    return usage
