"""Per-node circuit breaker."""

from __future__ import annotations

import enum
import time


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """closed -> open after `threshold` consecutive failures; open -> half-open after `cooldown`
    seconds (one probe allowed); half-open -> closed on success, open again on failure."""

    def __init__(self, threshold: int = 3, cooldown: float = 5.0, clock=time.monotonic) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.failures = 0
        self.opened_at = 0.0
        self._state = BreakerState.CLOSED

    @property
    def state(self) -> BreakerState:
        if self._state == BreakerState.OPEN and self.clock() - self.opened_at >= self.cooldown:
            self._state = BreakerState.HALF_OPEN
        return self._state

    @property
    def allows(self) -> bool:
        return self.state != BreakerState.OPEN

    def success(self) -> None:
        self.failures = 0
        self._state = BreakerState.CLOSED

    def failure(self) -> None:
        self.failures += 1
        if self.state == BreakerState.HALF_OPEN or self.failures >= self.threshold:
            self._state = BreakerState.OPEN
            self.opened_at = self.clock()
