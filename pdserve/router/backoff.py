"""Retry backoff with jitter: retries after one node failure must not arrive in lockstep."""

from __future__ import annotations

import random

MAX_BACKOFF = 5.0
"""No retry waits longer than this (seconds), however many came before it."""


def backoff_delay(base: float, attempt: int, rng: random.Random | None = None, cap: float = MAX_BACKOFF) -> float:
    """Seconds before retry number `attempt` (1, 2, ...): exponential in `attempt` from `base`, capped,
    with "equal jitter": a uniform draw from the upper half. Requests that failed together (a node
    died under them) spread over that half instead of hitting the next node at one instant, and
    each still waits at least half the exponential step."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    step = min(cap, base * 2 ** min(attempt - 1, 30))
    return (rng or random).uniform(step / 2, step)
