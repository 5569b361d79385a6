"""KvSubscriber: one task per node that keeps the router's KvIndex equal to the node's KV events.

The node streams a snapshot (possibly in chunks, complete at `snapshot_done`), then events with
seq = previous + 1 (proto/pdserve/v1/common.proto, KvEventsRequest / KvEventBatch). The
subscriber resumes a dropped stream with (after_seq, node_id), so the node sends only what was
missed; it asks for a fresh snapshot (after_seq = 0) after a gap or a malformed stream, and
forgets everything of an incarnation when the node_id changes (the node restarted).

While the stream is down or a snapshot is incomplete, the node is not synced in the index, so
its entries are never used for routing (a stale entry could send a prompt to a node that has
evicted it). Reconnects back off exponentially with jitter, so a restarted cluster is not
hammered by every router at once. A node that does not implement KvEvents (UNIMPLEMENTED) is
cold: asked again only every `unsupported_retry` seconds, and logged once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any

import grpc

from pdserve.engine.kv_events import Medium
from pdserve.v1 import common_pb2
from pdserve.router.kv_index import KvIndex
from pdserve.router.kv_tiers import TIERS, medium_of

log = logging.getLogger("pdserve.router.kv")
STORED, REMOVED, CLEARED = common_pb2.KvEvent.STORED, common_pb2.KvEvent.REMOVED, common_pb2.KvEvent.CLEARED


class Resync(Exception):
    """The stream broke the contract (a gap, events before the snapshot): start over from a snapshot."""


class KvSubscriber:
    """Follows one node's KvEvents stream into `index` under the node's `address`."""

    def __init__(
        self,
        address: str,
        stub: Any,
        index: KvIndex,
        metadata: tuple = (),
        backoff: float = 0.2,
        max_backoff: float = 10.0,
        unsupported_retry: float = 60.0,
    ) -> None:
        self.address = address
        self.stub = stub
        self.index = index
        self.metadata = metadata
        self.backoff, self.max_backoff, self.unsupported_retry = backoff, max_backoff, unsupported_retry
        self.node_id = ""
        self.last_seq = 0
        self.unsupported = False
        self.last_message: float | None = None
        """monotonic time of the last batch received (for the staleness metric)."""
        self.resyncs: Counter[str] = Counter()
        """Snapshots asked for or incarnations dropped, by reason (gap, restart, dropped, unusable, error)."""
        self._pending: dict[Medium | None, set[int]] | None = None
        """Keys of a snapshot still arriving in chunks, by medium (None: no snapshot in progress)."""
        self._pending_seq = 0
        self._call: Any = None  # the grpc.aio stream call, cancelled on reset
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop following and forget the node's entries (it left the cluster)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.index.drop(self.address)

    def reset(self, reason: str = "reset") -> None:
        """Forget the node's entries now and follow it again from a snapshot (it became unusable)."""
        self.index.drop(self.address)
        self._resync(reason)
        if self._call is not None:
            self._call.cancel()

    def _resync(self, reason: str) -> None:
        self.resyncs[reason] += 1
        self.last_seq = 0
        self._pending = None

    async def _run(self) -> None:
        delay = self.backoff
        while True:
            seen = self.last_message
            try:
                await self._follow()
                self.resyncs["dropped"] += 1  # the node ended the stream (e.g. it is draining)
            except asyncio.CancelledError:
                if self._task is not None and self._task.cancelling():
                    raise
                delay = 0.0  # reset() cancelled the call: reconnect at once, for a snapshot
            except Resync as e:
                log.info("KV events of %s: %s; resyncing from a snapshot", self.address, e)
                self.index.drop(self.address)
                self._resync("gap")
                seen = self.last_message  # no backoff reset: a node that keeps breaking the contract is not hammered
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if not self.unsupported:
                        log.info("%s serves no KV events: routing treats it as cold", self.address)
                    self.unsupported = True
                    self.index.drop(self.address)
                    await asyncio.sleep(self.unsupported_retry)
                    continue
                self.resyncs["dropped"] += 1
                log.debug("KV events of %s dropped: %s", self.address, e.code().name)
            except Exception:  # a malformed message or a bug: never let the subscriber die
                log.exception("KV events of %s failed; resyncing from a snapshot", self.address)
                self.index.drop(self.address)
                self._resync("error")
                seen = self.last_message
            if self.last_message != seen and delay:
                delay = self.backoff  # the stream worked for a while: back off from the start (0: reset())
            self.unsupported = False
            self.index.suspend(self.address)  # stale until the resumed stream catches up
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # jitter: routers do not reconnect in step
            delay = min(max(delay * 2, self.backoff), self.max_backoff)

    async def _follow(self) -> None:
        request = common_pb2.KvEventsRequest(
            after_seq=self.last_seq, node_id=self.node_id, tiers=self.index.keeps_tiers
        )
        self._call = call = self.stub.KvEvents(request, metadata=self.metadata)
        try:
            async for batch in call:
                self.apply(batch)
        finally:
            self._call = None

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        """Apply one batch to the index; raises Resync when the stream broke the contract."""
        self.last_message = time.monotonic()
        if batch.node_id and batch.node_id != self.node_id:  # an empty node_id: the same incarnation
            if self.node_id:
                log.info("%s restarted (new node_id %s): its KV entries are dropped", self.address, batch.node_id)
                self.resyncs["restart"] += 1
            self.index.drop(self.address)  # nothing of the old incarnation is true any more
            self.node_id, self.last_seq, self._pending = batch.node_id, 0, None
            if not batch.snapshot:
                raise Resync("a new incarnation began without a snapshot")
        if batch.snapshot:
            self._snapshot_chunk(batch)
        elif self._pending is not None:
            raise Resync("events arrived before the snapshot was complete")
        elif not batch.events and batch.seq and batch.seq != self.last_seq:
            raise Resync(f"heartbeat at seq {batch.seq}, expected {self.last_seq}")
        for event in batch.events:
            if self._pending is not None:
                raise Resync("events arrived before the snapshot was complete")
            if event.seq != self.last_seq + 1:
                raise Resync(f"gap: seq {event.seq} after {self.last_seq}")
            self.last_seq = event.seq
            medium = medium_of(event.medium)
            if medium is None:
                continue  # an unknown medium's keys: kept out of the index, the sequence still followed
            if event.kind == STORED:
                self.index.store_in(self.address, event.keys, medium)
            elif event.kind == REMOVED:
                self.index.remove_from(self.address, event.keys, medium)
            elif event.kind == CLEARED:
                self.index.clear(self.address)
        if self._pending is None and self.last_seq and not self.index.is_synced(self.address):
            self.index.resume(self.address)  # the resumed stream continued without a gap

    def _snapshot_chunk(self, batch: common_pb2.KvEventBatch) -> None:
        if self._pending is None:
            self._pending, self._pending_seq = {}, 0
        self._pending_seq = max(self._pending_seq, batch.seq)  # whichever chunk carries it
        keys = self._pending.setdefault(medium_of(batch.snapshot_medium), set())  # None: an unknown medium, dropped
        room = self.index.node_cap - len(keys)  # a node never holds more keys than the cap
        keys.update(batch.snapshot_keys[: max(room, 0)])
        if batch.snapshot_done:
            pending, self._pending = self._pending, None
            self.index.replace(self.address, pending.pop(Medium.POOL, set()))
            for medium in TIERS:
                self.index.replace_tier(self.address, medium, pending.get(medium, set()))
            self.last_seq = self._pending_seq
