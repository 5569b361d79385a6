"""A hung node (probes missed) on either side of an attempt ends the wait for it at detection."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.backoff import backoff_delay
from pdserve.router.node_state import Route
from pdserve.router.deadlines import Deadlines
from tests.router.fake_nodes import FakeNode, fake_cluster

D1, D2, P1, P2 = (
    ("decode", "127.0.0.1:1"),
    ("decode", "127.0.0.1:2"),
    ("prefill", "127.0.0.1:3"),
    ("prefill", "127.0.0.1:4"),
)
PARAMS = common_pb2.SamplingParams(max_tokens=4)


def request(rid: str, params: common_pb2.SamplingParams = PARAMS) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=params)


def pin_first(cluster, decode: tuple[str, str], prefills: list[str]) -> None:
    """The first choice goes to `decode` with `prefills`; later ones to the balancer."""
    choose, calls = cluster._choose, []

    def pinned(tokens_needed, exclude, *route):
        calls.append(1)
        if len(calls) == 1:
            return Route(cluster.nodes[decode], prefills)
        return choose(tokens_needed, exclude, *route)

    cluster._choose = pinned


async def collect(cluster, rid: str) -> list[int]:
    return [t async for chunk in cluster.generate(request(rid)) for t in chunk.token_ids]


async def test_an_attempt_waiting_on_a_hung_prefill_node_is_retried_at_detection():
    """The decode node waits on a partitioned prefill node; the router abandons that attempt once the
    prefill node is hung (not at the first-token deadline) and retries it with the other one."""

    def waits_on_p1(request):
        return [None] if request.prefill_addresses[0] == P1[1] else [7, 8, 9, 10]

    fakes = {D1: FakeNode(waits_on_p1), D2: FakeNode(waits_on_p1), P1: FakeNode(), P2: FakeNode()}
    deadlines = Deadlines(hung_after=1.0, health_timeout=0.2, first_token_timeout=60.0, capacity_wait=5.0)
    cluster = await fake_cluster(fakes, refresh_interval=0.05, deadlines=deadlines, backoff=0.01)
    try:
        pin_first(cluster, D1, [P1[1]])
        task = asyncio.create_task(collect(cluster, "r"))
        await asyncio.sleep(0.1)
        fakes[P1].frozen = True  # partitioned after the attempt was sent
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await asyncio.wait_for(task, 20) == [7, 8, 9, 10]
        assert loop.time() - start < 10  # hung_after (1 s) + probes, far below first_token_timeout
        retry = [r for f in (fakes[D1], fakes[D2]) for r in f.requests if list(r.prefill_addresses) != [P1[1]]]
        assert retry and P1[1] not in retry[0].prefill_addresses
        assert not cluster.nodes[D1].stalled  # the decode node did nothing wrong
    finally:
        await cluster.stop()


async def test_a_stalled_stream_makes_its_node_hung_for_attempts_sent_before():
    """A stream stalls on a frozen decode node: the other attempt already waiting there for its first
    token is retried as soon as a probe confirms the silence, not `hung_after` (30 s) later."""
    frozen_after_two = {"r-a": [1, 2, None], "r-b": [None]}

    def d1(request):
        return frozen_after_two[request.request_id.rsplit("-", 2)[0]]

    fakes = {D1: FakeNode(d1), D2: FakeNode(lambda r: [5, 6, 7, 8][: r.params.max_tokens]), P1: FakeNode()}
    deadlines = Deadlines(hung_after=30.0, health_timeout=0.2, token_timeout=0.3, capacity_wait=5.0)
    cluster = await fake_cluster(fakes, refresh_interval=0.05, deadlines=deadlines, backoff=0.01)
    try:
        choose = cluster._choose
        cluster._choose = lambda n, exclude, *route: (
            Route(cluster.nodes[D1], [P1[1]]) if not exclude else choose(n, exclude, *route)
        )
        stream_a = cluster.generate(request("r-a"))
        assert (await stream_a.__anext__()).token_ids == [1]
        waiting_b = asyncio.create_task(collect(cluster, "r-b"))
        await asyncio.sleep(0.1)
        fakes[D1].frozen = True
        rest_a = [t async for chunk in stream_a for t in chunk.token_ids]
        assert rest_a == [2, 5, 6]  # migrated after the stall, no gap, no duplicate
        assert await asyncio.wait_for(waiting_b, 10) == [5, 6, 7, 8]
    finally:
        await cluster.stop()


def test_retry_backoff_is_jittered_exponential_and_capped():
    rng = random.Random(0)
    delays = [backoff_delay(0.1, 3, rng) for _ in range(200)]
    assert all(0.2 <= d <= 0.4 for d in delays) and len(set(delays)) > 100  # spread, not lockstep
    assert all(0.05 <= backoff_delay(0.1, 1, rng) <= 0.1 for _ in range(50))
    assert backoff_delay(0.1, 50, rng, cap=5.0) <= 5.0
    with pytest.raises(ValueError):
        backoff_delay(0.1, 0)


async def test_a_migrated_structured_stream_carries_the_tokens_its_grammar_already_took():
    """A structured-output stream stalls after two tokens: the attempt on the other decode node gets
    them in structured_outputs.generated_token_ids (its grammar resumes after them)."""
    params = common_pb2.SamplingParams(max_tokens=4)
    params.structured_outputs.kind, params.structured_outputs.spec = "regex", "[0-9]+"
    fakes = {D1: FakeNode(lambda r: [1, 2, None]), D2: FakeNode(lambda r: [5, 6]), P1: FakeNode()}
    deadlines = Deadlines(hung_after=30.0, health_timeout=0.2, token_timeout=0.3, capacity_wait=5.0)
    cluster = await fake_cluster(fakes, refresh_interval=0.05, deadlines=deadlines, backoff=0.01)
    try:
        pin_first(cluster, D1, [P1[1]])
        original = request("s", params)
        events = [e async for e in cluster.generate(original)]
        assert [t for e in events for t in e.token_ids] == [1, 2, 5, 6]
        usage = events[-1].usage  # the whole request's, not the last attempt's (5 prompt tokens, 2 generated)
        assert (usage.prompt_tokens, usage.completion_tokens) == (3, 4)
        moved = fakes[D2].requests[-1]
        assert moved.request_id == "s-0-1" and list(moved.prompt_token_ids) == [1, 2, 3, 1, 2]
        assert moved.params.max_tokens == 2  # what remains after the two tokens sent
        assert original == request("s", params)  # each attempt sends a copy
        assert list(moved.params.structured_outputs.generated_token_ids) == [1, 2]
        assert moved.params.structured_outputs.spec == "[0-9]+"
    finally:
        await cluster.stop()


async def test_a_busy_node_keeps_its_stream_while_it_reports_progress():
    """A stream whose next token is late on a node that answers its probes and reports progress
    (busy with long prompts) is waited for, not migrated at the token deadline."""
    rest = lambda r: [7, 8, 9, 10][4 - r.params.max_tokens :]  # noqa: E731 - what a migrated stream still needs
    fakes = {D1: FakeNode(lambda r: [7, None]), D2: FakeNode(rest)}
    deadlines = Deadlines(hung_after=30.0, health_timeout=0.2, token_timeout=0.3, first_token_timeout=2.0)
    cluster = await fake_cluster(fakes, refresh_interval=0.05, deadlines=deadlines, backoff=0.01)
    busy = True

    async def work() -> None:
        while busy:
            fakes[D1].progress += 12
            await asyncio.sleep(0.05)

    worker = asyncio.create_task(work())
    try:
        pin_first(cluster, D1, [])
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await asyncio.wait_for(collect(cluster, "r"), 20) == [7, 8, 9, 10]
        # the stream moved only once the extension (first_token_timeout, 2 s) ran out, not at 0.3 s
        assert loop.time() - start >= 2.0
        (moved,) = fakes[D2].requests  # migrated once, after its first token
        assert list(moved.prompt_token_ids) == [1, 2, 3, 7]
    finally:
        busy = False
        await worker
        await cluster.stop()


async def test_a_node_whose_engine_computes_nothing_is_hung_though_it_answers_probes():
    """A wedged engine thread (probes still answered): once its reported stall passes hung_after the
    node gets no new requests and its attempts are retried elsewhere at once."""
    fakes = {D1: FakeNode(lambda r: [None]), D2: FakeNode(lambda r: [7, 8, 9, 10])}
    deadlines = Deadlines(hung_after=1.0, health_timeout=0.2, first_token_timeout=60.0, capacity_wait=5.0)
    cluster = await fake_cluster(fakes, refresh_interval=0.05, deadlines=deadlines, backoff=0.01)
    try:
        pin_first(cluster, D1, [])
        task = asyncio.create_task(collect(cluster, "r"))
        await asyncio.sleep(0.3)
        fakes[D1].engine_stalled = 1.5
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await asyncio.wait_for(task, 20) == [7, 8, 9, 10]
        assert loop.time() - start < 5  # at the next probe, far below the 60 s first-token deadline
        assert not cluster.nodes[D1].usable
        fakes[D1].engine_stalled = 0.0  # it recovers: usable again after a probe
        await asyncio.sleep(0.3)
        assert cluster.nodes[D1].usable
    finally:
        await cluster.stop()
