"""The router's admission queue: requests that find no node with room (no decode node with the KV
for them, or every node that could prefill them already holding `--max-prefill-backlog` seconds of
prompts: router/saturation.py) wait here, in arrival order, and a full queue refuses new ones at
once (503 with Retry-After) instead of letting them pile up and fail later.

A request with nobody waiting ahead of it is routed at once. Otherwise it joins the queue; only the
request at the head asks for a node, so room that frees up goes to the longest-waiting request, not
to whichever poll happened to come first. An attempt of a request that already ran (a retry or a
migrated stream: work was done for it) joins at the head. A request leaves the queue when it gets a
node, when `capacity_wait` runs out (503), or when its client goes away.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Gauge, Histogram

from pdserve.openai_api.errors import NoCapacityError

T = TypeVar("T")
DEFAULT_MAX_WAITING = 256
"""Requests that may wait at the router for capacity (`--max-waiting-requests`) before new ones get 503."""
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
BOUND_SLACK = 0.5
"""Seconds past `capacity_wait` that a new request's wait may take (its last try and the refusal)."""


def check_limit(limit: int) -> int:
    """`limit` when it is a valid --max-waiting-requests, else ValueError naming the flag."""
    if limit < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {limit}")
    return limit


class QueueFull(NoCapacityError):
    """The admission queue holds `max_waiting_requests` already: refused before any work."""


class AdmissionQueue:
    """FIFO of requests waiting for capacity, at most `limit` long (new arrivals; retries and
    migrations are never refused by it)."""

    def __init__(self, limit: int, registry: CollectorRegistry, model_name: str, capacity_wait: float = 30.0) -> None:
        """`capacity_wait`: the longest a new request waits (the wait histogram gets a bucket just
        above it, so that its p99 can be checked against the bound)."""
        self.limit = check_limit(limit)
        self.retry_after = max(1.0, min(capacity_wait, 30.0))
        """What a refused client is told to wait: the time the queue's head may wait for room."""
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._since: dict[asyncio.Future, float] = {}
        """When each waiter joined (monotonic): the SLO planner counts a waiting request's wait so far."""
        self.refused = 0
        """Requests refused for capacity since start (full queue, or no room in time): the SLO planner
        counts them as demand that never got a TTFT."""
        self.depth = Gauge(
            "pdserve_router_requests_waiting",
            "requests waiting at the router for a decode node with room",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.wait_seconds = Histogram(
            "pdserve_router_queue_wait_seconds",
            "time requests waited at the router for a decode node with room (routed or refused)",
            ["model_name"],
            buckets=sorted({*WAIT_BUCKETS, capacity_wait + BOUND_SLACK}),
            registry=registry,
        ).labels(model_name)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def waits(self, now: float) -> list[float]:
        """Seconds each request now in the queue has waited so far."""
        return [now - t for t in self._since.values()]

    def check(self) -> None:
        """QueueFull when a new request could not join: the HTTP layer asks before any work."""
        if len(self._waiters) >= self.limit:
            self.refused += 1
            raise QueueFull(
                f"{len(self._waiters)} requests are already waiting for capacity; try again later",
                retry_after=self.retry_after,
            )

    async def route(self, choose: Callable[[], T], new: bool, wait: float, poll: float) -> T:
        """`choose()` (which raises NoCapacityError while there is no room) at once when nobody waits
        ahead or for a retry; else in the queue's order, trying every `poll` seconds for up to `wait`
        seconds, the last try at the deadline. NoCapacityError with Retry-After when nothing freed up."""
        if not self._waiters or not new:
            try:
                return choose()
            except NoCapacityError:
                pass
        deadline = time.monotonic() + wait
        async with self.turn(new, deadline):
            while True:
                try:
                    return choose()
                except NoCapacityError as e:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        raise NoCapacityError(e.message, retry_after=self.retry_after) from None
                await asyncio.sleep(min(poll, left))

    @contextlib.asynccontextmanager
    async def turn(self, new: bool, deadline: float) -> AsyncIterator[None]:
        """Wait (until `deadline`, monotonic) until this caller heads the queue; it stays the head
        until it leaves the block. `new`: a first attempt (joins at the tail, and is refused when the
        queue is full); else a retry or migration (joins at the head)."""
        if new:
            self.check()
        me: asyncio.Future = asyncio.get_running_loop().create_future()
        if new:
            self._waiters.append(me)
        else:
            self._waiters.appendleft(me)
        self.depth.set(len(self._waiters))
        start = self._since[me] = time.monotonic()
        try:
            if self._waiters[0] is not me:
                try:
                    await asyncio.wait_for(asyncio.shield(me), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    self.refused += 1
                    raise NoCapacityError(
                        "no decode node had room for this request in time; try again later",
                        retry_after=self.retry_after,
                    ) from None
            yield
        finally:
            self._waiters.remove(me)
            del self._since[me]
            self.depth.set(len(self._waiters))
            self.wait_seconds.observe(time.monotonic() - start)
            if self._waiters and not self._waiters[0].done():
                self._waiters[0].set_result(None)  # the next request's turn
