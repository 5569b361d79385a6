"""Saturation (router/saturation.py): a node's backlog is its pending prompt tokens over the prefill
rate it has sustained; while every node that could prefill a prompt holds `max_prefill_backlog`
seconds of them, a new request waits in the router's admission queue instead of in a node's queue."""

from __future__ import annotations

import time

import pytest

from pdserve.node_runtime.discovery import Member
from pdserve.node_runtime.discovery.static import StaticDiscovery
from pdserve.openai_api.errors import NoCapacityError
from pdserve.router.balancer import NodeLoad
from pdserve.router.cluster import Cluster
from pdserve.router.deadlines import Deadlines
from pdserve.router.node_state import NodeState
from pdserve.router.prefill_offload import Prefilling
from pdserve.router.saturation import PrefillRate, backlog_seconds, check_max_backlog


def test_the_rate_is_tokens_over_the_time_the_node_had_prompts_pending():
    rate = PrefillRate()
    assert rate.tokens_per_second is None  # unmeasured: never saturated
    rate.started(10.0)
    rate.finished(1000, 12.0, idle=False, computed=True)  # 1000 tokens in the first 2 s
    rate.finished(1000, 14.0, idle=True, computed=True)  # and 1000 more by 14 s: idle afterwards
    assert rate.tokens_per_second == pytest.approx(500.0)
    rate.started(100.0)  # idle time between 14 and 100 s does not count
    rate.finished(500, 101.0, idle=True, computed=True)
    assert rate.tokens_per_second == pytest.approx(500.0)


def test_an_attempt_without_a_first_token_measures_nothing():
    rate = PrefillRate()
    rate.started(0.0)
    rate.finished(1000, 50.0, idle=True, computed=False)  # the prefill node died: 50 s of nothing
    assert rate.tokens_per_second is None
    rate.started(100.0)
    rate.finished(300, 101.0, idle=False, computed=False)  # one attempt failed, the other went on
    rate.finished(600, 103.0, idle=True, computed=True)  # its 3 s count, not the last 2
    assert rate.tokens_per_second == pytest.approx(200.0)


def test_a_batch_finishing_at_one_instant_does_not_inflate_the_rate():
    """25 prompts of 300 tokens after one 10 s step: 750 tokens/s, however many finish together."""
    rate = PrefillRate()
    rate.started(0.0)
    for i in range(25):
        rate.finished(300, 10.0 + i * 1e-4, idle=i == 24, computed=True)
    assert rate.tokens_per_second == pytest.approx(750.0, rel=0.01)


def test_the_rate_follows_a_node_that_gets_slower():
    rate = PrefillRate()
    now = 0.0
    rate.started(now)
    for _ in range(5):
        now += 1.0
        rate.finished(1000, now, idle=False, computed=True)
    for _ in range(20):  # ten times slower now
        now += 10.0
        rate.finished(1000, now, idle=False, computed=True)
    assert rate.tokens_per_second == pytest.approx(100.0, rel=0.05)


def test_backlog_is_pending_tokens_over_the_rate():
    node = NodeLoad("p")
    first = Prefilling(node, 2000)
    first.first_token()
    node.prefill_rate.tokens, node.prefill_rate.seconds = 1000.0, 1.0  # measured: 1000 tokens/s
    pending = Prefilling(node, 3000)
    assert backlog_seconds(node.prefilling_tokens, node.prefill_rate) == pytest.approx(3.0)
    del pending  # a route chosen but never run (its client left) gives its tokens back
    assert node.prefilling_tokens == 0
    assert backlog_seconds(0, node.prefill_rate) == 0.0


def test_the_bound_defaults_to_a_quarter_of_the_first_token_deadline_and_is_checked():
    assert Deadlines().prefill_backlog == 30.0
    assert Deadlines(first_token_timeout=40.0).prefill_backlog == 10.0
    assert Deadlines(max_prefill_backlog=0).prefill_backlog == 0.0
    with pytest.raises(ValueError, match="--max-prefill-backlog .* --first-token-timeout"):
        Deadlines(max_prefill_backlog=200.0)
    with pytest.raises(ValueError, match="--max-prefill-backlog must be >= 0"):
        check_max_backlog(-1.0, 120.0)


def _cluster(backlog: float = 5.0) -> Cluster:
    return Cluster(StaticDiscovery([]), deadlines=Deadlines(max_prefill_backlog=backlog), routing="wrr")


def _node(cluster: Cluster, role: str, host: str, pending_seconds: float) -> NodeLoad:
    """A node with room, measured at 1000 tokens/s, with `pending_seconds` of prompts pending."""
    member = Member(role, host, 1)
    state = NodeState(member, channel=None, stub=None, health=None, load=NodeLoad(member.address))  # type: ignore[arg-type]
    state.load.report(1000, 1000, 16, 0, time.monotonic())
    state.load.prefill_rate.tokens, state.load.prefill_rate.seconds = 1000.0, 1.0
    state.load.prefilling_tokens = int(pending_seconds * 1000)
    cluster.nodes[(role, member.address)] = state
    return state.load


def test_a_saturated_prefill_node_sends_prompts_to_a_decode_node_with_time_to_spare():
    cluster = _cluster()
    _node(cluster, "prefill", "p", pending_seconds=6.0)
    _node(cluster, "decode", "d", pending_seconds=0.0)
    route = cluster._choose(100, set(), list(range(100)))
    assert route.prefills == []  # the decode node prefills it itself


def test_when_every_node_is_saturated_the_request_waits_at_the_router():
    cluster = _cluster()
    _node(cluster, "prefill", "p", pending_seconds=6.0)
    _node(cluster, "decode", "d", pending_seconds=5.0)
    with pytest.raises(NoCapacityError, match="queued prompts"):
        cluster._choose(100, set(), list(range(100)))
    cluster.nodes[("prefill", "p:1")].load.prefilling_tokens = 4000  # it drained below 5 s
    assert cluster._choose(100, set(), list(range(100))).prefills == ["p:1"]


def test_without_prefill_nodes_the_decode_nodes_backlog_bounds_admission():
    cluster = _cluster()
    _node(cluster, "decode", "d", pending_seconds=5.5)
    with pytest.raises(NoCapacityError):
        cluster._choose(100, set(), list(range(100)))


def test_an_unmeasured_node_takes_one_prompt_at_a_time_and_zero_turns_the_bound_off():
    cluster = _cluster()
    p = _node(cluster, "prefill", "p", pending_seconds=0.0)
    p.prefill_rate = PrefillRate()  # nothing measured yet
    d = _node(cluster, "decode", "d", pending_seconds=60.0)
    first = cluster._choose(100, set(), list(range(100)))
    assert first.prefills == ["p:1"]  # an idle node is never saturated
    with pytest.raises(NoCapacityError):  # but until that prompt comes back it takes no other
        cluster._choose(100, set(), list(range(100)))
    assert cluster.snapshot()[0]["prefill_backlog_s"] is None  # shown as unknown, not infinite
    del first
    d.prefilling_tokens = 0
    off = _cluster(backlog=0.0)
    _node(off, "prefill", "p", pending_seconds=600.0)
    _node(off, "decode", "d", pending_seconds=600.0)
    off._choose(100, set(), list(range(100)))


def test_requests_routed_together_count_each_others_prompts():
    """Admission happens before a request's attempt starts: a burst routed in one go must see the
    prompts routed just before it, or every one of them would find the nodes idle."""
    cluster = _cluster()
    _node(cluster, "prefill", "p", pending_seconds=0.0)
    _node(cluster, "decode", "d", pending_seconds=0.0)
    routes = []
    with pytest.raises(NoCapacityError):
        for _ in range(100):
            routes.append(cluster._choose(1000, set(), list(range(1000))))  # 1 s of work each
    assert 5 <= len(routes) <= 12  # about 5 s on the prefill node, then 5 s on the decode node
    routes.clear()  # the routes end: nothing is pending any more
    assert all(n.load.prefilling_tokens == 0 for n in cluster.nodes.values())
