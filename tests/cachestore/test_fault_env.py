"""The test-only fault hook that chaos runs set in a node's environment."""

from __future__ import annotations

import time

from pdserve.cachestore import FaultInjector


def test_fault_injector_from_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_FAULT_WRITE_FAIL_RATE", raising=False)
    monkeypatch.delenv("PDSERVE_FAULT_WRITE_DELAY_RATE", raising=False)
    assert FaultInjector.from_env() is None  # production: no injector at all
    monkeypatch.setenv("PDSERVE_FAULT_WRITE_FAIL_RATE", "0.25")
    monkeypatch.setenv("PDSERVE_FAULT_SEED", "7")
    faults = FaultInjector.from_env()
    failed = sum(not faults.before_write() for _ in range(4000))
    assert faults.fail_rate == 0.25 and 800 < failed < 1200
    again, same_seed = FaultInjector.from_env(), FaultInjector(0.25, seed=7)
    assert [again.before_write() for _ in range(50)] == [same_seed.before_write() for _ in range(50)]


def test_delay_from_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_FAULT_WRITE_FAIL_RATE", raising=False)
    monkeypatch.setenv("PDSERVE_FAULT_WRITE_DELAY_RATE", "1")
    monkeypatch.setenv("PDSERVE_FAULT_WRITE_DELAY_SECONDS", "0.02")
    faults = FaultInjector.from_env()
    assert faults is not None and (faults.fail_rate, faults.delay_rate, faults.delay_seconds) == (0.0, 1.0, 0.02)
    start = time.monotonic()
    assert all(faults.before_write() for _ in range(3))  # delayed, never failed
    assert time.monotonic() - start >= 0.06
