"""The test-only fault hook that chaos runs set in a node's environment."""

from __future__ import annotations

from cachestore import FaultInjector


def test_fault_injector_from_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_FAULT_WRITE_FAIL_RATE", raising=False)
    assert FaultInjector.from_env() is None  # production: no injector at all
    monkeypatch.setenv("PDSERVE_FAULT_WRITE_FAIL_RATE", "0.25")
    monkeypatch.setenv("PDSERVE_FAULT_SEED", "7")
    faults = FaultInjector.from_env()
    failed = sum(not faults.before_write() for _ in range(4000))
    assert faults.fail_rate == 0.25 and 800 < failed < 1200
    again, same_seed = FaultInjector.from_env(), FaultInjector(0.25, seed=7)
    assert [again.before_write() for _ in range(50)] == [same_seed.before_write() for _ in range(50)]
