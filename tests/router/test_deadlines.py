"""The token deadline never undercuts a slow-but-alive node, and bad settings are refused."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.deadlines import Deadlines, StreamStalled, TokenDeadline, events_within_deadline


def test_token_deadline_has_a_floor_and_grows_with_observed_itl():
    d = TokenDeadline(Deadlines(token_timeout=2.0, itl_factor=20.0, first_token_timeout=60.0))
    assert d.timeout(first=True) == 60.0
    assert d.timeout(first=False) == 2.0  # nothing observed yet
    for _ in range(200):
        d.observe(0.01)  # a fast node: the floor holds
    assert d.timeout(first=False) == 2.0
    for _ in range(200):
        d.observe(0.5)  # a slow node (big model, loaded machine): 20 x its ITL, not a false migration
    assert d.timeout(first=False) == pytest.approx(10.0, rel=0.05)


@pytest.mark.parametrize("field", ["token_timeout", "itl_factor", "first_token_timeout", "health_timeout"])
def test_non_positive_deadlines_are_refused(field):
    with pytest.raises(ValueError, match=field):
        Deadlines(**{field: 0})


async def test_a_request_waits_for_capacity_then_fails_cleanly():
    """While `up` restarts a node (or every node is paused) requests wait, bounded by capacity_wait."""
    from pdserve.node_runtime.discovery.static import StaticDiscovery
    from pdserve.router.cluster import Cluster
    from pdserve.openai_api.errors import NoCapacityError

    cluster = Cluster(StaticDiscovery([]), refresh_interval=0.01, deadlines=Deadlines(capacity_wait=5.0))
    calls = []

    def choose(tokens_needed, exclude, *route):
        calls.append(tokens_needed)
        if len(calls) < 3:
            raise NoCapacityError("a node is restarting")
        return "node", ["prefill"]

    cluster._choose = choose
    assert await cluster._choose_waiting(10, set()) == ("node", ["prefill"]) and len(calls) == 3
    cluster.deadlines = Deadlines(capacity_wait=0.0)
    calls.clear()
    with pytest.raises(NoCapacityError):
        await cluster._choose_waiting(10, set())


async def test_a_stream_that_stops_sending_is_stalled_after_its_first_event():
    class HungCall:
        """Two events, then silence (a SIGSTOPped node keeps its connection open)."""

        def __init__(self) -> None:
            self.events = ["e1", "e2"]

        async def read(self):
            if self.events:
                return self.events.pop(0)
            await asyncio.Event().wait()

    deadline = TokenDeadline(Deadlines(token_timeout=0.2, first_token_timeout=30.0))
    got = []
    with pytest.raises(StreamStalled):
        async for event in events_within_deadline(HungCall(), deadline):
            got.append(event)
    assert got == ["e1", "e2"]


async def test_a_hung_node_ends_the_wait_for_a_first_event() -> None:
    """Before the first token only a long deadline runs (prefill may be slow); a node that stopped
    answering its probes ends the wait early, without re-issuing the stream's read."""

    class SilentCall:
        reads = 0

        async def read(self):
            SilentCall.reads += 1
            await asyncio.Event().wait()

    state = {"hung": False}
    deadline = TokenDeadline(Deadlines(first_token_timeout=60.0))
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, state.update, {"hung": True})
    start = loop.time()
    with pytest.raises(StreamStalled, match="health probes") as stalled:
        async for _ in events_within_deadline(SilentCall(), deadline, lambda first: "n:1" if state["hung"] else None):
            pass
    assert loop.time() - start < 30  # far below the 60 s first-token deadline
    assert SilentCall.reads == 1
    assert stalled.value.culprit == "n:1"


async def test_a_live_node_keeps_its_slow_first_event() -> None:
    class SlowCall:
        async def read(self):
            await asyncio.sleep(1.2)  # longer than a hung-check interval
            return "first"

    deadline = TokenDeadline(Deadlines(first_token_timeout=60.0))
    got = [e async for e in _take_one(events_within_deadline(SlowCall(), deadline, lambda first: None))]
    assert got == ["first"]


async def _take_one(stream):
    async for event in stream:
        yield event
        return


class _OneThenSilent:
    """One event, then silence (the node is busy with other work, or lost the stream)."""

    def __init__(self) -> None:
        self.sent = False

    async def read(self):
        if not self.sent:
            self.sent = True
            return "e1"
        await asyncio.Event().wait()


async def _seconds_to_stall(deadline: TokenDeadline, progress, before=lambda: None) -> float:
    """Seconds from the stream's first event until StreamStalled ends it."""
    loop = asyncio.get_running_loop()
    start = None
    with pytest.raises(StreamStalled):
        async for _ in events_within_deadline(_OneThenSilent(), deadline, lambda first: None, progress):
            start = loop.time()
            before()
    assert start is not None
    return loop.time() - start


async def test_a_late_event_from_a_node_that_reports_progress_is_waited_for() -> None:
    """Past the token deadline, an attempt whose nodes' reported progress grew waits on (a busy node
    is slow, not hung); once the progress stops growing, the deadline ends it."""
    loop = asyncio.get_running_loop()
    layers = {"n": 0, "until": 0.0}

    def work() -> None:  # the node computes for 1 s after the first event, then stops
        if loop.time() < layers["until"]:
            layers["n"] += 1
            loop.call_later(0.05, work)

    def begin() -> None:
        layers["until"] = loop.time() + 1.0
        work()

    deadline = TokenDeadline(Deadlines(token_timeout=0.3, first_token_timeout=30.0))
    waited = await _seconds_to_stall(deadline, lambda first: layers["n"], begin)
    assert 1.0 <= waited < 2.0, waited  # past the 0.3 s deadline while it worked, then one deadline more


async def test_progress_extends_a_wait_by_at_most_the_first_token_timeout() -> None:
    """A node that works for other requests but lost this stream still ends it."""
    counter = iter(range(10**9))
    deadline = TokenDeadline(Deadlines(token_timeout=0.2, first_token_timeout=0.6))
    waited = await _seconds_to_stall(deadline, lambda first: next(counter))
    assert 0.7 <= waited < 1.5, waited  # the 0.2 s deadline plus at most 0.6 s of progress


async def test_a_stream_with_no_progress_stalls_at_its_deadline() -> None:
    deadline = TokenDeadline(Deadlines(token_timeout=0.2, first_token_timeout=30.0))
    waited = await _seconds_to_stall(deadline, lambda first: 7)
    assert 0.2 <= waited < 1.0, waited
