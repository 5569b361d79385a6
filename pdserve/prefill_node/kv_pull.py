"""PullReceiver: the prefill node's end of a D->P pull (it receives, the decode node sends).

1. `offer` (PreparePull): the engine's pull connector (`PullConnector`, `pdserve.engine.kv_pull`,
   which the node built its engine with) reserves fresh blocks for the held prefix blocks this node
   lacks, and a CacheStore session over exactly those opens in this node's pool; its credentials
   go back to the decode node, which writes the blocks.
2. `claim` (at the start of the Prefill call that follows): the session is closed, every writer
   is fenced off (`wait_fenced`), and only then are the blocks keyed (the decode node said every
   write was acknowledged and the session is complete) or freed unkeyed (anything else).
3. An offer nobody claims (the decode node died or gave up) is settled the same way, unkeyed,
   after --kv-timeout. A settle runs to its end even if the call that started it is cancelled,
   so a pull never leaks a block and no late write ever lands in a block the engine reuses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pdserve.cachestore import CacheStoreServer, Session, SessionState
from pdserve.engine.kv_pull import PullConnector
from pdserve.node_runtime.kv_store import wait_fenced
from pdserve.node_runtime.node import NodeRuntime
from pdserve.v1 import prefill_pb2

log = logging.getLogger("pdserve.prefill")


@dataclass
class _Pending:
    session: Session
    timer: asyncio.TimerHandle


class PullReceiver:
    """Pending pulls of one prefill node, by request id (at most one per request): their sessions
    here, their blocks in `connector` (the engine's, called on the engine thread only)."""

    def __init__(self, rt: NodeRuntime, connector: PullConnector, cachestore: CacheStoreServer, timeout: float) -> None:
        self.rt = rt
        self.connector = connector
        self.cachestore = cachestore
        self.timeout = timeout
        self.pending: dict[str, _Pending] = {}
        self._settling: dict[str, asyncio.Task] = {}
        self.closed = False
        """Set when the node stops: no new offers."""

    async def offer(
        self, rid: str, prompt: list[int], held_tokens: int, min_blocks: int, salt: str | None
    ) -> prefill_pb2.PullOffer:
        """Reserve blocks for what this node lacks of the held prefix; an empty offer if nothing is
        worth pulling (fewer than `min_blocks` missing, no room, prefix caching off)."""
        await self.settle(rid, landed=False)  # a retried offer replaces the old one
        if self.closed or self.rt.draining:
            return prefill_pb2.PullOffer()
        call, connector = self.rt.loop_thread.call, self.connector
        got = await call(connector.reserve, rid, prompt, held_tokens, min_blocks, salt)
        if got is None:
            return prefill_pb2.PullOffer()
        block_ids, first = got
        if self.closed:  # the node began stopping while the engine reserved the blocks
            await call(connector.finish, rid, False)
            return prefill_pb2.PullOffer()
        try:
            creds = self.cachestore.open_session(rid, block_ids, timeout=self.timeout)
        except BaseException:
            await call(connector.finish, rid, False)
            raise
        session = self.cachestore.get_session(rid)
        assert session is not None  # opened just above
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout, lambda: asyncio.ensure_future(self.settle(rid, landed=False)))
        self.pending[rid] = _Pending(session, timer)
        return prefill_pb2.PullOffer(kv_destination=creds.to_bytes(), first_block=first)

    async def claim(self, rid: str, pulled: bool) -> bool:
        """The Prefill call for `rid` starts: settle its pull, if any. True if the blocks landed and
        are now in this node's prefix cache."""
        return await self.settle(rid, landed=pulled)

    async def settle(self, rid: str, landed: bool) -> bool:
        """Close, fence, then key (if `landed` and the session completed) or free the pull's blocks.
        Shielded: a cancelled caller does not stop it half way."""
        task = self._settling.get(rid)
        if task is None or task.done():
            pending = self.pending.pop(rid, None)
            if pending is None:
                return False
            task = asyncio.ensure_future(self._settle(rid, pending, landed))
            self._settling[rid] = task
            task.add_done_callback(lambda _: self._settling.pop(rid, None))
        return await asyncio.shield(task)

    async def _settle(self, rid: str, pending: _Pending, landed: bool) -> bool:
        pending.timer.cancel()
        session = pending.session
        self.cachestore.close_session(rid)  # cuts off any writer still inside the blocks
        await wait_fenced(session, rid)
        complete = landed and session.state == SessionState.COMPLETE
        if landed and not complete:
            log.warning("request_id=%s event=pull_incomplete landed=%d/%d", rid, len(session.landed), session.expected)
        keyed = await self.rt.loop_thread.call(self.connector.finish, rid, complete)
        log.debug("request_id=%s event=pull_settled complete=%s keyed_blocks=%d", rid, complete, keyed)
        return complete

    async def close(self) -> None:
        """Node stop: every pending pull is settled unkeyed (before the engine thread stops)."""
        self.closed = True
        await asyncio.gather(*(self.settle(rid, landed=False) for rid in list(self.pending)), return_exceptions=True)
