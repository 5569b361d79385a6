"""Receiver sessions: which blocks a request's sender may write, and when it is done."""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import time
from collections.abc import Callable, Iterable

from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.geometry import PoolGeometry


class SessionState(enum.Enum):
    OPEN = "open"
    COMPLETE = "complete"
    CLOSED = "closed"
    EXPIRED = "expired"


class SessionError(Exception):
    """The session ended before every (layer, block) landed (closed or expired)."""


class Session:
    """One request's destination blocks on the receiver.

    Writers (TCP receiver threads, local copies) call `begin_write` under the
    registry lock and `end_write` when their bytes are in; `wait_safe_to_reuse`
    resolves once the session is closed and no writer is inside its blocks, the
    moment the owner may give the blocks back to its allocator.

    Fencing: each writer registers a `cut` callable. When the session ends
    (closed, expired), the registry calls every live writer's `cut`, which stops
    it from landing more bytes (the TCP receiver shuts its socket down), so the
    wait for writers is short whatever order the timeouts fire in. A write that
    ends after the session ended is refused, never acknowledged.

    RDMA grants (remote keys for the session's blocks, `cachestore.rdma_access`) count like
    writers: the session is safe to reuse only once every grant's revocation has completed.
    """

    def __init__(
        self, creds: SessionCredentials, geometry: PoolGeometry, timeout: float, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.creds = creds
        self.request_id = creds.request_id
        self.geometry = geometry
        self.block_set = frozenset(creds.block_ids)
        self._sorted_blocks = sorted(self.block_set)
        self.token = bytes.fromhex(creds.token)
        """The token as it travels in a frame header (compared once per frame)."""
        self.expected = creds.num_layers * len(creds.block_ids)
        self.landed: set[tuple[int, int]] = set()
        """(layer, block) pairs whose every expected head has landed."""
        self.heads = creds.heads()
        """The heads each block expects (a tensor-parallel rank's share), or None: whole blocks."""
        self._partial: dict[tuple[int, int], int] = {}
        """(layer, block) -> bitmask of the heads landed so far, while several senders fill one block."""
        self.layers_done: dict[int, int] = {}
        self.state = SessionState.OPEN
        self.opened_at = time.monotonic()
        self.deadline = self.opened_at + timeout
        self.first_layer_at: float | None = None
        self.completed_at: float | None = None
        self.active_writers = 0
        self._fences: dict[int, Callable[[], None]] = {}
        self._writer_ids = itertools.count()
        self._grants: dict[int, Callable[[], None]] = {}
        self.closed = False
        """Removed from the registry: no new write can start."""
        self._loop = loop
        self._waiters: list[asyncio.Future] = []

    def owns_range(self, first: int, count: int) -> bool:
        """Whether blocks first .. first+count-1 all belong to the session, without iterating the range:
        the ids are distinct, so they do iff the session's id at `first`'s position plus count-1 is
        first+count-1."""
        ids = self._sorted_blocks
        i = bisect.bisect_left(ids, first)
        last = i + count - 1
        return count > 0 and i < len(ids) and ids[i] == first and last < len(ids) and ids[last] == first + count - 1

    # called with the registry lock held ------------------------------------------------------
    def begin_write(self, cut: Callable[[], None] | None = None) -> int:
        """One more writer inside the blocks; `cut` stops it at once (called when the session ends)."""
        self.active_writers += 1
        writer = next(self._writer_ids)
        if cut is not None:
            self._fences[writer] = cut
        return writer

    def end_write(
        self, writer: int, layer: int, block_ids: Iterable[int], ok: bool, heads: tuple[int, int] | None = None
    ) -> tuple[bool, bool, bool]:
        """Record landed blocks (with `heads`: only those heads of each block landed; a block counts
        once all the session's heads did, whichever senders wrote them). Returns (accepted, completed,
        wake): a write that ends after the session ended is not accepted (its sender must not be told
        OK); completed: this write finished it; wake: the owner's waiters must be woken (`signal`),
        which the caller does outside the lock and, on the tcp path, after its ack is on the wire."""
        wake = False
        self.active_writers -= 1
        self._fences.pop(writer, None)
        was_open = self.state == SessionState.OPEN
        accepted = ok and not self.closed
        if accepted and was_open:
            blocks_per_layer = len(self.block_set)
            for b in self._whole(layer, block_ids, heads):
                if (layer, b) not in self.landed:
                    self.landed.add((layer, b))
                    done = self.layers_done.get(layer, 0) + 1
                    self.layers_done[layer] = done
                    if done == blocks_per_layer and self.first_layer_at is None:
                        self.first_layer_at = time.monotonic()
            if len(self.landed) == self.expected:
                self.state = SessionState.COMPLETE
                self.completed_at = time.monotonic()
                wake = True
        if self.closed and self.safe_to_reuse:  # only wait_safe_to_reuse cares: no wake-up per write
            wake = True
        return accepted, was_open and self.state == SessionState.COMPLETE, wake

    def _whole(self, layer: int, block_ids: Iterable[int], heads: tuple[int, int] | None) -> Iterable[int]:
        """The blocks of `block_ids` that are whole once `heads` of them landed."""
        if heads is None or self.heads is None or heads == (self.heads.first, self.heads.stop):
            return block_ids
        first = self.heads.first
        mask = ((1 << (heads[1] - heads[0])) - 1) << (heads[0] - first)
        full = (1 << self.heads.count) - 1
        whole = []
        for b in block_ids:
            got = self._partial.get((layer, b), 0) | mask
            if got == full:
                self._partial.pop((layer, b), None)
                whole.append(b)
            else:
                self._partial[(layer, b)] = got
        return whole

    def add_grant(self, revoke: Callable[[], None]) -> int:
        """Remote keys now reach the blocks until `revoke` has run and `end_grant` is called."""
        grant = next(self._writer_ids)
        self._grants[grant] = revoke
        return grant

    def end_grant(self, grant: int) -> None:
        """The grant's keys are invalid: no byte can land through them any more."""
        self._grants.pop(grant, None)
        if self.closed and self.safe_to_reuse:
            self._signal()

    def grants(self) -> list[tuple[int, Callable[[], None]]]:
        return list(self._grants.items())

    def end(self, state: SessionState) -> list[Callable[[], None]]:
        """Closed or expired: no new writes; a session that already completed stays COMPLETE.
        Called with the registry lock held; returns the live writers' cuts for the caller to run."""
        self.closed = True
        if self.state == SessionState.OPEN:
            self.state = state
        self._signal()
        return list(self._fences.values())

    def signal(self) -> None:
        """Wake the owner's waiters (wait_complete, wait_safe_to_reuse) on its event loop."""
        self._signal()

    def _signal(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    # owner API ------------------------------------------------------------------------
    async def _wait(self, predicate) -> None:
        while not predicate():
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            if predicate():  # re-check after registering: no lost wake-up
                break
            await fut

    async def wait_complete(self, timeout: float | None = None) -> None:
        """Wait (by notification, no polling) until every (layer, block) has landed."""

        async def done() -> None:
            await self._wait(lambda: self.state != SessionState.OPEN)

        await asyncio.wait_for(done(), timeout)
        if self.state != SessionState.COMPLETE:
            raise SessionError(
                f"KV session {self.request_id} {self.state.value} before all layers landed "
                f"({len(self.landed)}/{self.expected} blocks)"
            )

    async def wait_safe_to_reuse(self, timeout: float | None = None) -> None:
        """Wait until the session is over and no writer can still touch its blocks: every TCP writer
        is out and every RDMA grant's keys are invalidated (after which a posted WRITE fails)."""

        async def idle() -> None:
            await self._wait(lambda: self.safe_to_reuse)

        await asyncio.wait_for(idle(), timeout)

    @property
    def safe_to_reuse(self) -> bool:
        return self.closed and self.active_writers == 0 and not self._grants
