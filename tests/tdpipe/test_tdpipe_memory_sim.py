"""AI-based greedy prefill: incremental futurePoint memory equals brute force."""

from __future__ import annotations

import random

import pytest

from pdserve.tdpipe.memory_sim import FutureMemory, FuturePointsConfig, brute_force_usage


@pytest.mark.parametrize("seed", range(20))
def test_incremental_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    cfg = FuturePointsConfig(
        capacity_blocks=10_000,
        block_size=rng.choice([1, 16, 32]),
        interval=rng.choice([8, 32]),
        horizon=rng.choice([128, 256]),
    )
    memory = FutureMemory(cfg)
    requests = []
    for _ in range(rng.randint(0, 40)):
        req = (rng.randint(1, 1024), rng.randint(0, 300), rng.randint(1, 400))
        memory.add(*req)
        requests.append(req)
        assert memory.usage == brute_force_usage(requests, cfg)


def test_remove_undoes_add_and_offset_counts_from_join() -> None:
    cfg = FuturePointsConfig(capacity_blocks=100, block_size=16, interval=32, horizon=128)
    memory = FutureMemory(cfg)
    memory.add(100, 1, 80)
    before = list(memory.usage)
    memory.add(50, 1, 200, offset=40)
    # Joined at step 40: absent at point 32, (50+1+24)/16 -> 5 blocks at point 64.
    assert memory.usage[0] == before[0] and memory.usage[1] == before[1] + 5
    memory.remove(50, 1, 200, offset=40)
    assert memory.usage == before


def test_switch_when_any_future_point_exceeds_capacity() -> None:
    cfg = FuturePointsConfig(capacity_blocks=10, block_size=16, interval=32, horizon=64)
    memory = FutureMemory(cfg)
    memory.add(64, 1, 100)  # 97 tokens at step 32 -> 7 blocks; 129 at step 64 -> 9 blocks
    assert memory.usage == [7, 9]
    assert not memory.would_overflow(16, 1, 20)  # finishes before step 32: costs nothing
    assert memory.would_overflow(16, 1, 64)  # +2 blocks at step 32 is fine, +6 at 64 is not
    assert not memory.overflows()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        FuturePointsConfig(capacity_blocks=0)
    with pytest.raises(ValueError, match="interval"):
        FuturePointsConfig(capacity_blocks=1, interval=64, horizon=32)
