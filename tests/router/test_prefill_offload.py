"""Prefill offload (router/prefill_offload.py): while every prefill node is saturated, the router sends
a request without prefill addresses, so its decode node prefills the prompt itself; otherwise (and
with the policy off) prompts go to the prefill node as before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdserve.node_runtime.discovery import Member
from pdserve.node_runtime.discovery.static import StaticDiscovery
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.balancer import NodeLoad
from pdserve.router.cluster import Cluster
from pdserve.router.deadlines import Deadlines
from pdserve.router.prefill_offload import Offload, OffloadPolicy, Prefilling, pending_tokens
from tests.router.kv_fake_node import FakeKvNode, FakePrefill, serve, until

PROMPT = list(range(1, 140))  # 139 tokens, the benchmark's chat prompt
NO_BOUND = Deadlines(max_prefill_backlog=0)
"""The backlog bound off (tests/router/test_saturation.py covers it): the offload policy alone."""


def load(address: str, queued: int = 0) -> NodeLoad:
    return NodeLoad(address, prefilling_tokens=queued)


def test_pending_counts_prompts_until_their_first_token():
    node = load("p")
    first, second = Prefilling(node, 100), Prefilling(node, 39)
    assert pending_tokens(node) == 139
    first.done()
    first.done()  # idempotent: the first token and the end of the attempt both call it
    assert pending_tokens(node) == 39
    second.done()
    assert pending_tokens(node) == 0


def test_below_saturation_every_prompt_goes_to_a_prefill_node():
    policy = OffloadPolicy(256)
    assert policy.decide([load("p", queued=255)], load("d"), 139) is Offload.REMOTE


def test_saturated_prefill_sends_the_prompt_to_an_idle_decode_node():
    policy = OffloadPolicy(256)
    assert policy.decide([load("p", queued=278)], load("d"), 139) is Offload.LOCAL


def test_a_decode_node_with_a_longer_queue_does_not_take_it():
    policy = OffloadPolicy(256)
    # 150 pending + 139 > 278: the prompt would start later there than at the prefill node
    assert policy.decide([load("p", queued=278)], load("d", queued=150), 139) is Offload.REMOTE


def test_the_least_loaded_prefill_node_decides():
    policy = OffloadPolicy(256)
    assert policy.decide([load("p0", queued=1000), load("p1", queued=10)], load("d"), 139) is Offload.REMOTE


def test_off_and_without_prefill_nodes_it_never_offloads():
    assert OffloadPolicy(0).decide([load("p", queued=10_000)], load("d"), 139) is Offload.REMOTE
    assert OffloadPolicy(256).decide([], load("d"), 139) is Offload.REMOTE


def test_assign_local_counts_the_prompt_in_the_decode_nodes_load():
    d = NodeLoad("d")
    OffloadPolicy.assign_local(d, 139)
    assert d.inflight_tokens == 139


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="prefill-saturated-tokens"):
        OffloadPolicy(-1)


@pytest.mark.parametrize("routing", ["wrr", "kv-aware"])
async def test_cluster_offloads_a_wave_between_prefill_and_decode_nodes(routing):
    """A wave of 8 prompts at once, none answered yet: the prefill node takes the first ones until it
    is saturated, then the decode nodes take prompts while their queues are shorter."""
    prefill = FakePrefill()
    served = [await serve(FakeKvNode(num_blocks=512)), await serve(FakeKvNode(num_blocks=512)), await serve(prefill)]
    roles = ["decode", "decode", "prefill"]
    members = [Member(r, "127.0.0.1", int(a.rsplit(":", 1)[1])) for r, (_, a) in zip(roles, served)]
    cluster = Cluster(
        StaticDiscovery(members), refresh_interval=60, routing=routing, offload=OffloadPolicy(256), deadlines=NO_BOUND
    )
    await cluster.start()
    try:
        where, routes = [], []
        for _ in range(8):
            route = cluster._choose(len(PROMPT) + 64, set(), PROMPT, None)
            routes.append(route)  # held, its prompt stays pending on its node, as while an attempt runs
            where.append(route.node.member.address if not route.prefills else "prefill")
        assert 2 <= where.count("prefill") <= 4, where
        local = [w for w in where if w != "prefill"]
        assert len(set(local)) == 2 and max(local.count(a) for a in set(local)) <= 3, where
        for r in routes:  # every first token came back: nothing is pending any more
            r.prefilling.first_token()
        assert all(n.load.prefilling_tokens == 0 for n in cluster.nodes.values())
        assert cluster._choose(len(PROMPT) + 64, set(), PROMPT, None)[1] == [served[2][1]]
    finally:
        await cluster.stop()
        for s, _ in served:
            await s.stop(None)


async def test_a_stale_report_of_a_long_queue_does_not_offload():
    """A load report taken while a long prompt was in flight says "saturated" after it finished:
    the router goes by the prompts it still waits on, so the next request goes to the prefill node;
    with prompts in flight it offloads, and with the policy off it never does."""
    served = [await serve(FakeKvNode(num_blocks=512)), await serve(FakePrefill(queued=5000))]
    members = [Member(r, "127.0.0.1", int(a.rsplit(":", 1)[1])) for r, (_, a) in zip(["decode", "prefill"], served)]
    on = Cluster(StaticDiscovery(members), refresh_interval=0.05, routing="wrr", deadlines=NO_BOUND)
    off = Cluster(
        StaticDiscovery(members), refresh_interval=0.05, routing="wrr", offload=OffloadPolicy(0), deadlines=NO_BOUND
    )
    await on.start()
    await off.start()
    try:
        prefills = [n for c in (on, off) for n in c.nodes.values() if n.member.role == "prefill"]
        await until(lambda: all(n.load.queued_prefill_tokens == 5000 for n in prefills))
        held = []
        for cluster in (on, off):
            assert cluster._choose(len(PROMPT) + 64, set(), PROMPT, None)[1] == [served[1][1]]  # given back
            node, addresses, *_ = cluster._choose(len(PROMPT) + 64, set(), PROMPT, None)
            held.append(cluster._prefilling(node, addresses, 300))  # a long prompt in flight at the prefill node
        assert on._choose(len(PROMPT) + 64, set(), PROMPT, None)[1] == []
        assert off._choose(len(PROMPT) + 64, set(), PROMPT, None)[1] == [served[1][1]]
    finally:
        await on.stop()
        await off.stop()
        for s, _ in served:
            await s.stop(None)


class GatedNode(FakeKvNode):
    """A decode node whose stream waits for `gate` before its one token (a prefill in progress)."""

    def __init__(self) -> None:
        super().__init__(num_blocks=512)
        self.gate = asyncio.Event()

    async def Generate(self, request, context):
        await self.gate.wait()
        async for event in super().Generate(request, context):
            yield event


@contextlib.asynccontextmanager
async def decode_and_prefill(decode: FakeKvNode, **cluster_kw) -> AsyncIterator[tuple[Cluster, str]]:
    """A started Cluster over `decode` and one FakePrefill node (wrr routing), and the prefill node's
    address; both nodes and the cluster are stopped afterwards."""
    served = [await serve(decode), await serve(FakePrefill())]
    members = [Member(r, "127.0.0.1", int(a.rsplit(":", 1)[1])) for r, (_, a) in zip(["decode", "prefill"], served)]
    cluster = Cluster(StaticDiscovery(members), routing="wrr", **cluster_kw)
    await cluster.start()
    try:
        yield cluster, served[1][1]
    finally:
        await cluster.stop()
        for s, _ in served:
            await s.stop(None)


async def test_generate_counts_the_prompt_on_its_prefill_node_until_the_first_token():
    decode = GatedNode()
    async with decode_and_prefill(decode, refresh_interval=0.05) as (cluster, _):
        prefill = next(n.load for n in cluster.nodes.values() if n.member.role == "prefill")
        params = common_pb2.SamplingParams(max_tokens=1)
        request = decode_pb2.GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, params=params)
        task = asyncio.ensure_future(_drain(cluster.generate(request)))
        await until(lambda: prefill.prefilling_tokens == len(PROMPT))
        decode.gate.set()
        assert await task == [5]
        assert all(n.load.prefilling_tokens == 0 for n in cluster.nodes.values())
        # an attempt that ends without a token (cancelled) releases its count too
        decode.gate.clear()
        request.request_id = "r2"
        task = asyncio.ensure_future(_drain(cluster.generate(request)))
        await until(lambda: prefill.prefilling_tokens == len(PROMPT))
        task.cancel()
        await until(lambda: prefill.prefilling_tokens == 0)


async def _drain(stream) -> list[int]:
    return [t async for chunk in stream for t in chunk.token_ids]
