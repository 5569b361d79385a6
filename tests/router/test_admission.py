"""The router's admission queue (issue 54): requests that find no decode node with room wait in
arrival order, a retry or migration goes first, a full queue refuses new requests at once with 503 and
Retry-After (also a stream, before it starts), and the depth and the waits are metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdserve.node_runtime.discovery.static import StaticDiscovery
from pdserve.openai_api.errors import NoCapacityError
from pdserve.router.admission import QueueFull
from pdserve.router.cluster import Cluster
from pdserve.router.deadlines import Deadlines


def _cluster(limit: int, capacity_wait: float = 10.0) -> tuple[Cluster, dict]:
    """A Cluster whose nodes have room for `room["n"]` more requests (each routed one takes it)."""
    registry = CollectorRegistry()
    cluster = Cluster(
        StaticDiscovery([]),
        refresh_interval=0.01,
        deadlines=Deadlines(capacity_wait=capacity_wait),
        registry=registry,
        max_waiting_requests=limit,
    )
    room = {"n": 0, "registry": registry}

    def choose(tokens_needed, exclude, *route):
        if room["n"] <= 0:
            raise NoCapacityError("full")
        room["n"] -= 1
        return f"node-for-{tokens_needed}"

    cluster._choose = choose
    return cluster, room


def _metric(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"model_name": "unknown"}) or 0.0


async def test_waiting_requests_are_routed_in_arrival_order():
    cluster, room = _cluster(limit=8)
    order: list[int] = []

    async def request(i: int) -> None:
        await cluster._choose_waiting(i, set())
        order.append(i)

    tasks = []
    for i in range(1, 5):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0.02)  # arrival order 1, 2, 3, 4
    assert cluster.queue.waiting == 4 and _metric(room["registry"], "pdserve_router_requests_waiting") == 4
    for _ in range(4):  # room for one more at a time: the longest-waiting request takes it
        room["n"] += 1
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks)
    assert order == [1, 2, 3, 4]
    assert cluster.queue.waiting == 0
    assert _metric(room["registry"], "pdserve_router_queue_wait_seconds_count") == 4


async def test_a_retry_or_migration_goes_ahead_of_new_requests():
    cluster, room = _cluster(limit=8)
    order: list[str] = []

    async def request(name: str, new: bool) -> None:
        await cluster._choose_waiting(1, set(), new=new)
        order.append(name)

    first = asyncio.create_task(request("new-1", True))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(request("new-2", True))
    await asyncio.sleep(0.02)
    migrated = asyncio.create_task(request("migrated", False))
    await asyncio.sleep(0.02)
    for _ in range(3):
        room["n"] += 1
        await asyncio.sleep(0.1)
    await asyncio.gather(first, second, migrated)
    assert order.index("migrated") < order.index("new-2")


async def test_a_full_queue_refuses_new_requests_at_once_with_retry_after():
    cluster, room = _cluster(limit=2, capacity_wait=30.0)
    waiting = [asyncio.create_task(cluster._choose_waiting(1, set())) for _ in range(2)]
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(QueueFull) as refused:
        await cluster._choose_waiting(1, set())
    assert loop.time() - start < 0.5 and refused.value.retry_after >= 1
    with pytest.raises(QueueFull):
        cluster.check_admission()  # what the HTTP layer asks before any work
    # a migrated stream is never refused for a full queue: it waits, first in line
    migrated = asyncio.create_task(cluster._choose_waiting(1, set(), new=False))
    room["n"] = 3
    assert await asyncio.wait_for(migrated, 5) == "node-for-1"
    await asyncio.gather(*waiting)


async def test_a_request_that_waits_past_capacity_wait_gets_503_with_retry_after():
    cluster, _ = _cluster(limit=4, capacity_wait=0.3)
    head = asyncio.create_task(cluster._choose_waiting(1, set()))
    await asyncio.sleep(0.02)
    behind = asyncio.create_task(cluster._choose_waiting(2, set()))
    for task in (head, behind):
        with pytest.raises(NoCapacityError) as e:
            await asyncio.wait_for(task, 5)
        assert e.value.retry_after is not None
    assert cluster.queue.waiting == 0


async def test_a_client_that_leaves_while_waiting_frees_its_place():
    cluster, room = _cluster(limit=4)
    head = asyncio.create_task(cluster._choose_waiting(1, set()))
    await asyncio.sleep(0.02)
    behind = asyncio.create_task(cluster._choose_waiting(2, set()))
    await asyncio.sleep(0.02)
    head.cancel()
    await asyncio.sleep(0.05)
    room["n"] = 1
    assert await asyncio.wait_for(behind, 5) == "node-for-2"
    assert cluster.queue.waiting == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_api_answers_503_with_retry_after_before_any_work(make_client, stream):
    make, _, fake_cluster = make_client

    class Full(fake_cluster):
        def check_admission(self) -> None:
            raise QueueFull("256 requests are already waiting for capacity; try again later", retry_after=30)

    cluster = Full([1, 2, 3])
    async with make(cluster) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream})
    assert r.status_code == 503 and r.headers["retry-after"] == "30"
    assert r.json()["error"]["code"] == "no_capacity"
    assert not cluster.requests  # nothing was sent to a node


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_that_waited_in_vain_gets_503_not_a_started_stream(make_client, stream):
    """The real Cluster with no decode node: the request waits `capacity_wait` in the admission queue,
    and then the answer is a 503 status with Retry-After, never a 200 whose stream carries the error."""
    make, _, _ = make_client
    cluster = Cluster(StaticDiscovery([]), refresh_interval=0.01, deadlines=Deadlines(capacity_wait=0.3))
    async with make(cluster) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "no_capacity"
    assert cluster.queue.waiting == 0
