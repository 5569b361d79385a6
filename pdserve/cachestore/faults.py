"""Opt-in fault injection for reliability tests: fail or delay a fraction of writes."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field


@dataclass
class FaultInjector:
    """Seeded, so a failing test reproduces. Applied by the sender before each write."""

    fail_rate: float = 0.0
    """Fraction of writes that fail (the transfer then fails cleanly)."""
    delay_rate: float = 0.0
    """Fraction of writes delayed by `delay_seconds`."""
    delay_seconds: float = 0.05
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("fail_rate", "delay_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"FaultInjector.{name} must be in [0, 1], got {getattr(self, name)}")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """TEST-ONLY hook for runs of whole processes (benchmarks/chaos.py, tests/e2e): a sender fails a
        fraction $PDSERVE_FAULT_WRITE_FAIL_RATE of its writes and delays a fraction
        $PDSERVE_FAULT_WRITE_DELAY_RATE by $PDSERVE_FAULT_WRITE_DELAY_SECONDS, seeded by
        $PDSERVE_FAULT_SEED. Neither rate set: no injector."""
        env = os.environ
        fail, delay = env.get("PDSERVE_FAULT_WRITE_FAIL_RATE"), env.get("PDSERVE_FAULT_WRITE_DELAY_RATE")
        if not fail and not delay:
            return None
        return cls(
            fail_rate=float(fail or 0.0),
            delay_rate=float(delay or 0.0),
            delay_seconds=float(env.get("PDSERVE_FAULT_WRITE_DELAY_SECONDS", "0.05")),
            seed=int(env.get("PDSERVE_FAULT_SEED", "0")),
        )

    def before_write(self) -> bool:
        """Sleep if this write is delayed; return False if it must fail."""
        if self.delay_rate and self._rng.random() < self.delay_rate:
            time.sleep(self.delay_seconds)
        return not (self.fail_rate and self._rng.random() < self.fail_rate)
