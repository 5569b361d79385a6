"""How long the router waits on a node before it calls the node hung.

A paused or wedged node (SIGSTOP, a stuck GIL, a partitioned host) keeps its TCP
connections open, so nothing fails: streams just stop. Two deadlines turn that
into a failure the router can act on:

- the health-check deadline: a probe that gets no answer in `health_timeout`
  seconds marks the node unresponsive, so new requests stop going to it;
- the per-stream token deadline: a stream that gets no event for
  `token_timeout` seconds after its first token is cancelled and migrated;
- the hung-node deadline: a node that has missed every health probe for
  `hung_after` seconds, or whose stream stalled past its token deadline, is
  hung. Every attempt that needs it (its decode node, and before the first
  event its prefill nodes too) is abandoned at that moment and retried or
  migrated elsewhere, whenever it was sent. The first event itself may
  legitimately take long (a long prompt's prefill), so it has no short clock
  of its own; a node that stopped answering probes altogether is not
  computing it.

The token deadline must not fire on a node that is merely slow (a loaded CI
machine, a big model), so it is never shorter than `itl_factor` times the
inter-token latency the router has been observing (a moving average). And a
deadline that passes while the nodes the attempt waits on report progress
(decoder layers computed, in their load reports) starts again instead of
failing the attempt, for up to `first_token_timeout` more: a busy node is
slow, not hung, and a slower answer is better than a migration that recomputes
and re-sends everything.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from pdserve.router.saturation import BACKLOG_SHARE, check_max_backlog


@dataclass(frozen=True)
class Deadlines:
    """Router-side deadlines on nodes (seconds)."""

    token_timeout: float = 2.0
    """Migrate a stream that gets no token for this long (raised to --itl-factor x the observed
    inter-token latency on slow nodes)."""
    itl_factor: float = 20.0
    """The token deadline is at least this many times the stream's mean inter-token latency."""
    first_token_timeout: float = 120.0
    """Wait this long for a first token (the prefill of a long prompt can take long)."""
    health_timeout: float = 1.0
    """A node that misses a health check by this long gets no new requests until it answers."""
    hung_after: float = 10.0
    """A node that has missed every health check for this long is hung: requests still waiting for
    their first token on it are retried on another node. Long enough that a loaded but live node
    answers a probe in between."""
    capacity_wait: float = 30.0
    """A request (or a stream being migrated) waits this long for a usable node with room, e.g. while
    `pdserve up` restarts a node, before a 503 (0: fail at once)."""
    max_prefill_backlog: float | None = None
    """Seconds of queued prompts (at the rate it has sustained) a node may hold; while every node
    holds that much, new requests wait at the router (--capacity-wait) instead of in the nodes'
    queues (0: no bound; default a quarter of --first-token-timeout, 30)."""

    def __post_init__(self) -> None:
        for name in ("token_timeout", "itl_factor", "first_token_timeout", "health_timeout", "hung_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.capacity_wait < 0:
            raise ValueError(f"capacity_wait must be >= 0, got {self.capacity_wait}")
        if self.max_prefill_backlog is None:
            object.__setattr__(self, "max_prefill_backlog", self.first_token_timeout * BACKLOG_SHARE)
        check_max_backlog(self.prefill_backlog, self.first_token_timeout)

    @property
    def prefill_backlog(self) -> float:
        """`max_prefill_backlog` as resolved at construction (0: no bound)."""
        return self.max_prefill_backlog or 0.0


class TokenDeadline:
    """The current token deadline: max(floor, itl_factor x moving average of observed gaps)."""

    def __init__(self, deadlines: Deadlines, alpha: float = 0.05) -> None:
        self.deadlines = deadlines
        self.alpha = alpha
        self.mean_itl = 0.0

    def observe(self, gap: float) -> None:
        self.mean_itl = gap if self.mean_itl == 0.0 else (1 - self.alpha) * self.mean_itl + self.alpha * gap

    def timeout(self, first: bool) -> float:
        if first:
            return self.deadlines.first_token_timeout
        return max(self.deadlines.token_timeout, self.deadlines.itl_factor * self.mean_itl)


class StreamStalled(Exception):
    """A node sent nothing within the stream's token deadline, or a node the attempt needs is hung."""

    def __init__(self, message: str, culprit: str | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit
        """Address of the hung node that ended the wait (None: the stream's own deadline)."""


HungCheck = Callable[[bool], "str | None"]
"""Called with `first` (no event yet): the address of a hung node the attempt depends on, else None."""
ProgressCheck = Callable[[bool], int]
"""Called with `first`: a count that grows while the nodes the attempt waits on compute."""


async def events_within_deadline(
    call, deadline: TokenDeadline, hung: HungCheck | None = None, progress: ProgressCheck | None = None
) -> AsyncIterator:
    """The events of a gRPC response stream, each within the token deadline (else StreamStalled).
    `hung(first)` names a node the attempt needs that was declared hung (its decode node; before
    the first event also its prefill nodes): the wait ends as soon as that happens, also for an
    attempt sent before it did. `progress(first)`: when the deadline passes and this has grown
    since the wait began (or since the deadline last passed), the deadline starts again, up to
    `first_token_timeout` past the first one (a node that works for others but lost this stream
    still ends it). While the
    caller is not asking for the next event (a client that reads slowly) no clock runs."""
    first, last = True, time.monotonic()
    while True:
        timeout = deadline.timeout(first)
        event = await _read(call, timeout, timeout + deadline.deadlines.first_token_timeout, first, hung, progress)
        if event is grpc.aio.EOF:
            return
        now = time.monotonic()
        if not first:
            deadline.observe(now - last)
        first, last = False, now
        yield event


HUNG_CHECK_INTERVAL = 0.1
"""How often a wait for an event looks at its nodes' health (a dict lookup and a clock read)."""


async def _read(
    call, timeout: float, limit: float, first: bool, hung: HungCheck | None, progress: ProgressCheck | None
):
    # One read, watched in slices: cancelling and re-issuing reads on a gRPC stream is not safe.
    read = asyncio.ensure_future(call.read())
    start = time.monotonic()
    end = start + timeout
    mark = progress(first) if progress is not None else None
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                now = progress(first) if progress is not None else None
                waited = time.monotonic() - start
                if now is None or now == mark or waited >= limit:
                    raise StreamStalled(f"no {'first ' if first else ''}event for {waited:.1f} s")
                mark, end = now, min(start + limit, time.monotonic() + timeout)  # the nodes work: wait on
                continue
            done, _ = await asyncio.wait({read}, timeout=min(left, HUNG_CHECK_INTERVAL))
            if done:
                return read.result()
            culprit = hung(first) if hung is not None else None
            if culprit is not None:
                raise StreamStalled(f"node {culprit} is hung (it stopped answering its health probes)", culprit)
    finally:
        if not read.done():
            read.cancel()
