"""KV-aware routing policy: cold prompts go by WRR, warm ones to their holder, without hot-spots."""

from __future__ import annotations

import random
from collections import Counter

from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.router.balancer import DecodeBalancer, NodeLoad
from pdserve.router.kv_policy import Candidate, PolicyParams, choose_decode, order_prefill, within_bound
from pdserve.router.kv_routing import KvRouter

COMPAT = "model=t;block_size=16"
NO_EXPLORE = PolicyParams(explore=0.0)


def loads(*free: int, queued: int = 0) -> list[NodeLoad]:
    out = []
    for i, f in enumerate(free):
        n = NodeLoad(f"n{i}")
        n.report(f, 1000, 16, queued, 100.0, COMPAT)
        out.append(n)
    return out


def hold(router: KvRouter, node: str, prompt: list[int], salt: str | None = None) -> None:
    """Node `node` holds every full block of `prompt` (as its KV events would say)."""
    if not router.index.is_synced(node):
        router.index.replace(node, [])
    router.index.store(node, prompt_block_keys(namespace_root(COMPAT, salt), prompt, 16))


def test_cold_prompts_follow_plain_wrr_exactly():
    kv, wrr = KvRouter(params=NO_EXPLORE), DecodeBalancer()
    a, b = loads(500, 300, 200), loads(500, 300, 200)
    prompt = list(range(64))
    kv_picks = [kv.choose_decode(a, prompt, None, 80, 100.0).node.address for _ in range(100)]
    wrr_picks = [wrr.pick(b, 80, 100.0).address for _ in range(100)]
    assert kv_picks == wrr_picks
    assert kv.decisions[("decode", "cold")] == 100


def test_warm_prompt_goes_to_its_holder_and_counts_the_hit():
    kv = KvRouter(params=NO_EXPLORE)
    nodes = loads(500, 500, 500)
    prompt = list(range(16 * 8 + 3))
    hold(kv, "n2", prompt)
    for n in ("n0", "n1"):
        kv.index.replace(n, [])
    assert {kv.choose_decode(nodes, prompt, None, 200, 100.0).node.address for _ in range(5)} == {"n2"}
    assert kv.decisions[("decode", "cache")] == 5
    assert kv.hit_blocks[("decode", "n2")] == 5 * 8 and kv.hit_tokens[("decode", "n2")] == 5 * 128


def test_chosen_nodes_uncached_tokens_are_what_it_would_prefill_itself():
    """`uncached_tokens`: the prompt less the chosen node's cached blocks. The router counts it
    in a decode node's own prefill queue when that node prefills locally; the trace replay's TTFT
    depends on it (without it every node looked idle and the replay lost its TTFT gain)."""
    kv = KvRouter(params=NO_EXPLORE)
    nodes = loads(500, 500)
    prompt = list(range(16 * 8 + 3))
    hold(kv, "n1", prompt[: 16 * 5])
    kv.index.replace("n0", [])
    assert kv.choose_decode(nodes, prompt, None, 200, 100.0) == (nodes[1], len(prompt) - 16 * 5)
    cold = list(range(1000, 1040))
    assert kv.choose_decode(nodes, cold, None, 60, 100.0).uncached_tokens == len(cold)


def test_no_cross_salt_hit():
    kv = KvRouter(params=NO_EXPLORE)
    nodes = loads(500, 500)
    prompt = list(range(16 * 6))
    hold(kv, "n1", prompt, salt="tenant-a")
    kv.index.replace("n0", [])
    assert kv.overlaps(nodes, prompt, "tenant-a") == {"n0": 0, "n1": 5}  # the last token's block never counts
    assert kv.overlaps(nodes, prompt, "tenant-b") == {"n0": 0, "n1": 0}
    assert kv.overlaps(nodes, prompt, None) == {"n0": 0, "n1": 0}
    kv.choose_decode(nodes, prompt, "tenant-b", 100, 100.0)
    assert kv.decisions[("decode", "cold")] == 1


def test_unsynced_node_is_never_matched():
    kv = KvRouter(params=NO_EXPLORE)
    prompt = list(range(16 * 6))
    hold(kv, "n1", prompt)
    kv.index.suspend("n1")  # its event stream is down: what it held may be stale
    assert kv.overlaps(loads(500, 500), prompt, None)["n1"] == 0


def test_hot_spot_bound_skips_an_overloaded_holder():
    cands = [Candidate("a", 50, 30.0), Candidate("b", 0, 5.0), Candidate("c", 0, 5.0)]
    d = choose_decode(cands, 50, NO_EXPLORE, random.Random(0))  # a is cheapest (30 < 55) but 30 > 1.25 x 13.3
    assert d.reason == "balance" and "a" not in d.addresses
    assert [c.address for c in within_bound(cands, 0.25, 0.0)] == ["b", "c"]
    assert within_bound([Candidate("a", 0, 5.0)], 0.0, 0.0)[0].address == "a"  # never empty


def test_shared_system_prompt_does_not_pin_traffic_on_one_node():
    """Every prompt starts with the same system prompt: traffic still spreads within the bound."""
    kv = KvRouter(params=PolicyParams(explore=0.0, balance_eps=0.25), seed=1)
    nodes = loads(4000, 4000, 4000, 4000)
    system = list(range(16 * 32))
    for n in nodes:
        kv.index.replace(n.address, [])
    hold(kv, "n0", system)
    picks: Counter[str] = Counter()
    for i in range(400):
        prompt = system + [10_000 + i * 50 + j for j in range(48)]
        chosen = kv.choose_decode(nodes, prompt, None, len(prompt) + 16, 100.0).node
        DecodeBalancer.assign(chosen, len(prompt) + 16)  # its load grows (no report in between)
        hold(kv, chosen.address, prompt)  # and it now holds the system prompt too
        picks[chosen.address] += 1
    mean = sum(picks.values()) / len(nodes)
    assert len(picks) == 4 and max(picks.values()) <= 1.3 * mean
    assert kv.decisions[("decode", "cache")] + kv.decisions[("decode", "tie")] > 0


def test_explore_routes_some_warm_requests_by_wrr():
    cands = [Candidate("a", 10, 0.0), Candidate("b", 0, 0.0)]
    rng = random.Random(3)
    reasons = Counter(choose_decode(cands, 10, PolicyParams(explore=0.1), rng).reason for _ in range(1000))
    assert 50 <= reasons["explore"] <= 150 and reasons["cache"] == 1000 - reasons["explore"]


def test_prefill_order_weighs_cached_prefix_against_queue():
    cands = [Candidate("p0", 0, 0.0), Candidate("p1", 30, 100.0), Candidate("p2", 30, 900.0)]
    ranked, reason = order_prefill(cands, 640, 16, NO_EXPLORE)
    assert ranked == ["p1", "p0", "p2"] and reason == "cache"  # p1: 160 + 100 < p0: 640
    ranked, reason = order_prefill([Candidate("p0", 0, 0.0), Candidate("p1", 0, 5.0)], 640, 16, NO_EXPLORE)
    assert reason == "cold"


def test_prefill_choice_through_the_router_counts_inflight_uncached_tokens():
    kv = KvRouter(params=NO_EXPLORE)
    nodes = loads(500, 500, queued=0)
    prompt = list(range(16 * 10 + 1))
    hold(kv, "n1", prompt)
    kv.index.replace("n0", [])
    ordered, cached = kv.order_prefill(nodes, prompt, None)
    assert [n.address for n in ordered] == ["n1", "n0"]
    assert ordered[0].inflight_tokens == 1  # only the uncached token is queued there
    # what the decode node is told each holds (so it offers no D->P pull to a node that has it all)
    assert cached == {"n1": 160, "n0": 0}
    cold = kv.order_prefill(nodes, list(range(5000, 5100)), None).nodes
    assert cold[0].address == "n0"  # least queued (n1 has 1 in flight)
