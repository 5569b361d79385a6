"""Routing that knows tiers: KV events name their medium, the router's index keeps each node's host-tier
and store keys beside its pool's, and the policy prices a hit by where it lives (pool < host < store <
recompute). The node's real event stream (kv_event_batches) feeds the router's real subscriber here."""

from __future__ import annotations

import asyncio

from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.engine.kv_events import KvEventLog, Medium
from pdserve.node_runtime.kv_events_service import kv_event_batches
from pdserve.router.balancer import NodeLoad
from pdserve.router.kv_index import KvIndex
from pdserve.router.kv_policy import PolicyParams
from pdserve.router.kv_routing import KvRouter
from pdserve.router.kv_subscriber import KvSubscriber
from pdserve.router.kv_tiers import TieredKvIndex, TierHits
from pdserve.v1 import common_pb2

COMPAT = "model=t;block_size=4"
ROOT = namespace_root(COMPAT)
PROMPT = list(range(100, 117))  # 4 full blocks before the last token's
KEYS = prompt_block_keys(ROOT, PROMPT, 4, 4)
NO_EXPLORE = PolicyParams(explore=0.0)


async def follow(log: KvEventLog, sub: KvSubscriber, until_seq: int, tiers: bool = True) -> None:
    """Feed the node's real KvEvents batches into `sub` until it has applied `until_seq`."""
    stop = False
    request = common_pb2.KvEventsRequest(after_seq=sub.last_seq, node_id=sub.node_id, tiers=tiers)
    async for batch in kv_event_batches(log, "node-1", "cpu", request, lambda: stop):
        sub.apply(batch)
        if sub._pending is None and sub.last_seq >= until_seq:
            stop = True
            break


def subscriber(index: KvIndex, address: str) -> KvSubscriber:
    return KvSubscriber(address, stub=None, index=index)


def test_the_event_log_keeps_each_medium_apart():
    log = KvEventLog()
    log.stored(KEYS[:2], ROOT)
    log.stored(KEYS[2:], 0, Medium.HOST)
    log.stored([KEYS[3]], 0, Medium.STORE)
    log.cleared()  # the pool's reset leaves the tiers as they are
    snap = log.snapshot()
    assert snap.keys == frozenset()
    assert snap.tiers == {Medium.HOST: frozenset(KEYS[2:]), Medium.STORE: frozenset([KEYS[3]])}
    log.removed([KEYS[2]], Medium.HOST)
    assert log.snapshot().tiers[Medium.HOST] == frozenset([KEYS[3]])
    assert [e.medium for e in log.since(0) or []] == [Medium.POOL, Medium.HOST, Medium.STORE, Medium.POOL, Medium.HOST]


def test_a_tier_medium_keeps_a_bounded_set(monkeypatch):
    import pdserve.engine.kv_events as kv_events

    monkeypatch.setattr(kv_events, "TIER_KEYS_HELD", 3)
    log = KvEventLog()
    for key in range(10):
        log.stored([key], 0, Medium.STORE)
    assert log.snapshot().tiers[Medium.STORE] == frozenset({7, 8, 9})  # the oldest forgotten


async def test_the_router_learns_each_nodes_tiers_from_its_stream():
    log = KvEventLog()
    log.stored(KEYS[:1], ROOT)  # pool: block 0
    log.stored(KEYS[1:2], 0, Medium.HOST)  # host tier: block 1
    index = TieredKvIndex()
    sub = subscriber(index, "a")
    await follow(log, sub, log.seq)  # a snapshot with both media
    assert index.match_tiers(KEYS, "a") == TierHits(pool=1, host=1)
    log.stored(KEYS[2:4], 0, Medium.STORE)  # events after the snapshot
    await follow(log, sub, log.seq)
    assert index.match_tiers(KEYS, "a") == TierHits(pool=1, host=1, store=2)
    assert index.match_tiers(KEYS, "b") == TierHits()  # a node the router does not follow
    log.removed(KEYS[1:2], Medium.HOST)  # the run ends at the first block the node cannot get
    await follow(log, sub, log.seq)
    assert index.match_tiers(KEYS, "a") == TierHits(pool=1)


async def test_a_pool_only_subscriber_keeps_its_sequence_without_tier_keys():
    log = KvEventLog()
    log.stored(KEYS[:1], ROOT)
    log.stored(KEYS[1:], 0, Medium.HOST)
    log.stored(KEYS[1:2], KEYS[0])
    plain = KvIndex()  # an index that keeps no tiers asks without `tiers` (as an older router does)
    sub = subscriber(plain, "a")
    await follow(log, sub, log.seq, tiers=False)
    assert plain.match(KEYS, ["a"]) == {"a": 2} and plain.size == 2
    batches = []
    request = common_pb2.KvEventsRequest(after_seq=1, node_id="node-1", tiers=False)
    async for batch in kv_event_batches(log, "node-1", "cpu", request, lambda: any(b.events for b in batches)):
        batches.append(batch)
    events = [e for b in batches for e in b.events]
    assert [e.seq for e in events] == [2, 3] and not events[0].keys and events[0].medium == "host"


def test_a_store_block_counts_for_every_node_and_goes_with_its_reporter():
    index = TieredKvIndex()
    for node in ("a", "b"):
        index.replace(node, [])
    index.store_in("a", KEYS, Medium.STORE)  # node a wrote the prompt's blocks to the store
    assert index.match_tiers(KEYS, "b") == TierHits(store=4)
    index.suspend("a")  # a's stream is down: what it reported is not trusted until it resumes
    assert index.match_tiers(KEYS, "b") == TierHits()
    index.resume("a")
    index.drop("a")  # a restarted: everything it reported is forgotten
    assert index.match_tiers(KEYS, "b") == TierHits() and index.tiers[Medium.STORE].size == 0


def loads(*names: str) -> list[NodeLoad]:
    return [NodeLoad(n, total_blocks=500, free_blocks=500, compatibility=COMPAT, block_size=4) for n in names]


def test_a_hit_is_priced_by_where_it_lives():
    index = TieredKvIndex()
    for node in ("pool", "host", "store", "cold"):
        index.replace(node, [])
    index.store("pool", KEYS)
    index.store_in("host", KEYS, Medium.HOST)
    kv = KvRouter(index=index, params=NO_EXPLORE)
    nodes = loads("pool", "host", "cold")
    assert kv.tier_hits(nodes, PROMPT, None) == {"pool": TierHits(4), "host": TierHits(host=4), "cold": TierHits()}
    assert kv.choose_decode(nodes, PROMPT, None, 64, 0.0).node.address == "pool"
    assert kv.choose_decode(nodes[1:], PROMPT, None, 64, 0.0).node.address == "host"  # host beats recompute
    assert kv.tier_hit_blocks[("decode", Medium.HOST)] == 4
    order = kv.order_prefill(nodes, PROMPT, None)
    assert [n.address for n in order.nodes][:2] == ["pool", "host"]
    assert order.cached_tokens["host"] == 16  # restored, not computed: no D->P pull needed for it
    index.store_in("store", KEYS, Medium.STORE)  # now every node can restore the whole prompt
    hits = kv.tier_hits(loads("host", "cold"), PROMPT, None)
    assert hits == {"host": TierHits(host=4), "cold": TierHits(store=4)}
    assert kv.choose_decode(loads("host", "cold"), PROMPT, None, 64, 0.0).node.address == "host"  # host < store


def test_the_router_exports_tier_hits():
    from prometheus_client import CollectorRegistry

    from pdserve.router.kv_metrics import KvRoutingCollector

    index = TieredKvIndex()
    index.replace("host", [])
    index.store_in("host", KEYS, Medium.HOST)
    kv = KvRouter(index=index, params=NO_EXPLORE)
    kv.choose_decode(loads("host"), PROMPT, None, 64, 0.0)

    class Cluster:
        kv_router = kv
        nodes: dict = {}

    registry = CollectorRegistry()
    KvRoutingCollector(Cluster(), "m", registry)  # type: ignore[arg-type]
    labels = {"model_name": "m", "role": "decode", "medium": "host"}
    assert registry.get_sample_value("pdserve_router_tier_hit_blocks_total", labels) == 4
    assert registry.get_sample_value("pdserve_router_kv_tier_index_entries", {"model_name": "m", "medium": "host"}) == 4


def test_events_in_flight_do_not_hang_a_stopped_stream():
    async def main() -> None:
        log = KvEventLog()
        request = common_pb2.KvEventsRequest(tiers=True)
        got = [b async for b in kv_event_batches(log, "n", "cpu", request, lambda: True)]
        assert got == []

    asyncio.run(main())


def test_a_medium_the_router_does_not_know_is_kept_out_of_the_index():
    index = TieredKvIndex()
    sub = subscriber(index, "a")
    snapshot = [
        common_pb2.KvEventBatch(node_id="n", snapshot=True, snapshot_keys=KEYS[:1], snapshot_medium="cpu", seq=2),
        common_pb2.KvEventBatch(
            node_id="n", snapshot=True, snapshot_keys=KEYS[1:], snapshot_medium="nvme", seq=2, snapshot_done=True
        ),
    ]
    for batch in snapshot:
        sub.apply(batch)
    assert index.match_tiers(KEYS, "a") == TierHits(pool=1)  # the nvme keys are not taken for the pool's
    event = common_pb2.KvEvent(kind=common_pb2.KvEvent.STORED, seq=3, keys=KEYS[1:], medium="nvme")
    sub.apply(common_pb2.KvEventBatch(seq=3, events=[event]))
    assert sub.last_seq == 3 and index.match_tiers(KEYS, "a") == TierHits(pool=1)
