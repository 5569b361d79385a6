"""Cluster routing with KV events: warm prompts go to their holder; a dead node's entries are never used;
`--routing wrr` places requests exactly as before."""

from __future__ import annotations

import copy
import time

import pytest

from pdserve.engine.block_keys import namespace_root
from pdserve.node_runtime.discovery import Member
from pdserve.node_runtime.discovery.static import StaticDiscovery
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.balancer import DecodeBalancer
from pdserve.router.cluster import Cluster
from pdserve.router.kv_policy import PolicyParams
from pdserve.router.kv_routing import KvRouter
from tests.router.kv_fake_node import COMPAT, FakeKvNode, FakePrefill, serve, until

PROMPT = list(range(1, 42))  # 10 full blocks of 4 (+1 token)


@pytest.fixture
async def cluster_of_two():
    """Two fake decode nodes + a prefill node; yields (make_cluster, nodes, servers, addresses)."""
    nodes = [FakeKvNode(num_blocks=64), FakeKvNode(num_blocks=64)]
    served = [await serve(n) for n in nodes] + [await serve(FakePrefill())]
    roles = ["decode", "decode", "prefill"]
    members = [Member(r, "127.0.0.1", int(a.rsplit(":", 1)[1])) for r, (_, a) in zip(roles, served)]
    clusters: list[Cluster] = []

    async def make(routing: str) -> Cluster:
        kv = KvRouter(params=PolicyParams(explore=0.0))
        c = Cluster(StaticDiscovery(members), refresh_interval=0.05, routing=routing, kv_router=kv)
        c.decode_balancer = kv.decode_balancer
        await c.start()
        clusters.append(c)
        return c

    yield make, nodes, [s for s, _ in served], [a for _, a in served]
    for c in clusters:
        await c.stop()
    for s, _ in served:
        await s.stop(None)


async def test_warm_prompt_routes_to_holder_and_dead_node_entries_are_dropped(cluster_of_two):
    make, nodes, servers, addrs = cluster_of_two
    cluster = await make("kv-aware")
    index = cluster.kv_router.index
    await until(lambda: index.is_synced(addrs[0]) and index.is_synced(addrs[1]))
    nodes[1].fill(PROMPT, namespace_root(COMPAT, None))
    await until(lambda: index.node_size(addrs[1]) == 10)
    for _ in range(3):
        node, prefills, cached, _ = cluster._choose(len(PROMPT) + 8, set(), PROMPT, None)
        assert node.member.address == addrs[1] and prefills == [addrs[2]]
        assert cached == (0,)  # a prefill node without events: holds nothing as far as we know
        node.load.inflight_blocks = 0  # as if it finished and reported before the next request
    assert cluster.kv_router.decisions[("decode", "cache")] == 3
    assert cluster.kv_router.decisions[("prefill", "cold")] == 3  # the prefill node serves no events
    await servers[1].stop(None)  # the holder dies
    await until(lambda: not cluster.nodes[("decode", addrs[1])].usable)
    assert index.node_size(addrs[1]) == 0 and not index.is_synced(addrs[1])
    for _ in range(3):
        node, *_ = cluster._choose(len(PROMPT) + 8, set(), PROMPT, None)
        assert node.member.address == addrs[0]


async def test_wrr_routing_ignores_the_cache_and_matches_the_balancer(cluster_of_two):
    make, nodes, _, addrs = cluster_of_two
    nodes[1].fill(PROMPT, namespace_root(COMPAT, None))
    cluster = await make("wrr")
    assert all(n.kv is None for n in cluster.nodes.values())  # no event streams at all
    reference = DecodeBalancer()
    ref_loads = copy.deepcopy([cluster.nodes[("decode", a)].load for a in addrs[:2]])
    for _ in range(6):
        node, *_ = cluster._choose(len(PROMPT) + 8, set(), PROMPT, None)
        expected = reference.pick(ref_loads, len(PROMPT) + 8, time.monotonic())
        reference.assign(expected, len(PROMPT) + 8)
        assert node.member.address == expected.address
    assert sum(cluster.kv_router.decisions.values()) == 0


def test_unknown_routing_mode_is_refused():
    with pytest.raises(ValueError, match="routing"):
        Cluster(StaticDiscovery([]), routing="random")


async def test_generate_passes_cache_salt_and_reports_cached_tokens(cluster_of_two):
    make, nodes, _, addrs = cluster_of_two
    cluster = await make("kv-aware")
    index = cluster.kv_router.index
    await until(lambda: index.is_synced(addrs[0]) and index.is_synced(addrs[1]))
    nodes[1].fill(PROMPT, namespace_root(COMPAT, "tenant"))
    await until(lambda: index.node_size(addrs[1]) == 10)
    params = common_pb2.SamplingParams(max_tokens=1)
    salted = decode_pb2.GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, params=params, cache_salt="tenant")
    chunks = [c async for c in cluster.generate(salted)]
    assert nodes[1].salts == ["tenant"]  # routed to the holder of the salted prefix, salt passed on
    assert nodes[1].prefill_hints == [([addrs[2]], [0])]  # each prefill node's held prefix, as indexed
    assert chunks[-1].usage.cached_tokens == len(PROMPT) - 1
    await until(lambda: cluster.nodes[("decode", addrs[1])].load.inflight_blocks == 0)
    unsalted = decode_pb2.GenerateRequest(request_id="r2", prompt_token_ids=PROMPT, params=params)
    chunks = [c async for c in cluster.generate(unsalted)]
    assert sorted(nodes[0].salts + nodes[1].salts, key=str) == [None, "tenant"]
    assert cluster.kv_router.decisions[("decode", "cold")] == 1  # unsalted: no hit on the salted blocks


async def test_metrics_show_hits_decisions_index_and_lag(cluster_of_two):
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.router.kv_metrics import KvRoutingCollector

    make, nodes, _, addrs = cluster_of_two
    cluster = await make("kv-aware")
    registry = CollectorRegistry()
    KvRoutingCollector(cluster, "m", registry)
    index = cluster.kv_router.index
    await until(lambda: index.is_synced(addrs[0]) and index.is_synced(addrs[1]))
    nodes[1].fill(PROMPT, namespace_root(COMPAT, None))
    await until(lambda: index.node_size(addrs[1]) == 10)
    cluster._choose(len(PROMPT) + 8, set(), PROMPT, None)
    text = generate_latest(registry).decode()
    node = f'model_name="m",node="{addrs[1]}",role="decode"'
    assert f"pdserve_router_prefix_hit_blocks_total{{{node}}} 10.0" in text
    assert f"pdserve_router_prefix_hit_tokens_total{{{node}}} 40.0" in text
    assert 'pdserve_router_routing_decisions_total{model_name="m",reason="cache",role="decode"} 1.0' in text
    assert 'pdserve_router_kv_index_entries{model_name="m"} 10.0' in text
    assert f"pdserve_router_kv_synced{{{node}}} 1.0" in text
    assert f"pdserve_router_kv_events_seq{{{node}}} 1.0" in text
    assert f"pdserve_router_kv_events_age_seconds{{{node}}}" in text
