from __future__ import annotations

from collections import Counter

from pdserve.router.balancer import DecodeBalancer, NodeLoad, PrefillBalancer
from pdserve.router.circuit_breaker import BreakerState, CircuitBreaker


def nodes(*free: int, now: float = 100.0) -> list[NodeLoad]:
    out = []
    for i, f in enumerate(free):
        n = NodeLoad(f"n{i}", block_size=16)
        n.report(f, 1000, 16, 0, now)
        out.append(n)
    return out


def test_smooth_wrr_follows_weights_and_interleaves():
    b = DecodeBalancer()
    ns = nodes(500, 300, 200)
    picks = [b.pick(ns, 16, 100.0).address for _ in range(1000)]
    counts = Counter(picks)
    assert counts == {"n0": 500, "n1": 300, "n2": 200}
    # smooth: the heaviest node never takes more than 2 picks in a row at 5:3:2
    run = longest = 1
    for a, c in zip(picks, picks[1:]):
        run = run + 1 if a == c else 1
        longest = max(longest, run)
    assert longest <= 2


def test_inflight_assignments_lower_weight_until_next_report():
    b = DecodeBalancer()
    ns = nodes(100, 100)
    first = b.pick(ns, 16 * 60, 100.0)
    b.assign(first, 16 * 60)  # 60 blocks now in flight there
    assert first.effective_free == 40
    second = b.pick(ns, 16 * 60, 100.0)
    assert second is not first  # 40 free left: cannot fit another 60-block request
    first.report(100, 1000, 16, 0, 101.0)
    assert first.inflight_blocks == 0


def test_nodes_that_cannot_fit_are_skipped():
    b = DecodeBalancer()
    ns = nodes(2, 50)
    assert {b.pick(ns, 16 * 10, 100.0).address for _ in range(20)} == {"n1"}
    assert b.pick(nodes(2, 3), 16 * 10, 100.0) is None


def test_round_robin_fallback_when_reports_are_stale():
    b = DecodeBalancer(fresh_seconds=3.0)
    ns = nodes(1000, 10, 10, now=0.0)  # weights say n0, but reports are 100 s old
    picks = Counter(b.pick(ns, 16, 100.0).address for _ in range(300))
    assert picks == {"n0": 100, "n1": 100, "n2": 100}


def test_prefill_least_queued_then_round_robin():
    b = PrefillBalancer()
    ns = nodes(10, 10, 10)
    ns[0].queued_prefill_tokens = 500
    ns[1].queued_prefill_tokens = 100
    ns[2].queued_prefill_tokens = 100
    firsts = Counter(b.order(ns)[0].address for _ in range(10))
    assert set(firsts) == {"n1", "n2"} and abs(firsts["n1"] - firsts["n2"]) <= 1
    ns[2].inflight_tokens = 1000
    assert b.order(ns)[0].address == "n1" and b.order(ns)[-1].address == "n2"


def test_circuit_breaker_state_machine():
    t = [0.0]
    br = CircuitBreaker(threshold=2, cooldown=5.0, clock=lambda: t[0])
    br.failure()
    assert br.state == BreakerState.CLOSED and br.allows
    br.failure()
    assert br.state == BreakerState.OPEN and not br.allows
    t[0] = 5.0
    assert br.state == BreakerState.HALF_OPEN and br.allows
    br.failure()  # the probe failed: open again
    assert br.state == BreakerState.OPEN
    t[0] = 11.0
    assert br.state == BreakerState.HALF_OPEN
    br.success()
    assert br.state == BreakerState.CLOSED and br.failures == 0
