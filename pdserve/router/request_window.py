"""RequestWindow: the finished requests and capacity refusals of the last few seconds, as the SLO
planner judges them (router/slo_planner.py).

Raw samples rather than the vllm:* histograms: a histogram's buckets cannot say whether a quantile
sits just under or just over an SLO, and the planner's band is narrower than their spacing. A deque
in arrival order, trimmed from the left, because samples only ever leave oldest first.
"""

from __future__ import annotations

import collections
from typing import NamedTuple


class Finished(NamedTuple):
    """One request as the client saw it."""

    at: float
    """When it finished (monotonic)."""
    ttft: float
    """Seconds from arrival (queue time included) to its first token."""
    tpot: float | None
    """Mean seconds per output token after the first (None: fewer than two tokens)."""


class RequestWindow:
    """Finished requests and refusals of the last `seconds` (trimmed whenever read)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._finished: collections.deque[Finished] = collections.deque()
        self._refused: collections.deque[tuple[float, int]] = collections.deque()

    def finished(self, started: float, first: float | None, last: float | None, num_tokens: int, now: float) -> None:
        """A request that arrived at `started` got its first token at `first` and its last at `last`
        (None: it produced no token, so it has no TTFT and is not sampled)."""
        if first is None:
            return
        tpot = (last - first) / (num_tokens - 1) if last is not None and num_tokens > 1 else None
        self._finished.append(Finished(now, first - started, tpot))

    def refused(self, count: int, now: float) -> None:
        """`count` requests were refused for capacity since the last call."""
        if count > 0:
            self._refused.append((now, count))

    def read(self, now: float) -> tuple[list[float], list[float], int]:
        """TTFTs, TPOTs and the number refused over the last `seconds` before `now`."""
        start = now - self.seconds
        while self._finished and self._finished[0].at < start:
            self._finished.popleft()
        while self._refused and self._refused[0][0] < start:
            self._refused.popleft()
        ttfts = [f.ttft for f in self._finished]
        tpots = [f.tpot for f in self._finished if f.tpot is not None]
        return ttfts, tpots, sum(n for _, n in self._refused)
