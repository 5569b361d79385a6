"""KvEvents: the gRPC stream of the KV block keys a node holds, offered by both node services.

A subscriber (the router's index) gets a snapshot first, then every change in order. It resumes
with `after_seq` when the node still buffers every event after it (same `node_id`); otherwise it
gets a new snapshot. Memory is bounded for any subscriber: nothing is queued per subscriber; a
slow one reads the engine's bounded KvEventLog at its own pace, and once it falls further behind
than the log holds it gets a snapshot (bounded by the pool's size) instead of the lost events.

A subscriber that asks for `tiers` also gets the keys of the tiers below the pool (host tier,
shared store), each event and snapshot chunk naming its medium; one that does not (an older
router) gets each tier event with its sequence number but no keys, so its stream stays gap-free
and its index holds the pool's keys only.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncIterator, Callable

from pdserve.engine.kv_events import KvEvent, KvEventLog, KvSnapshot, Medium
from pdserve.node_runtime.grpc_errors import TooManySubscribers
from pdserve.v1 import common_pb2

if TYPE_CHECKING:
    from pdserve.node_runtime.node import NodeRuntime

SNAPSHOT_CHUNK_KEYS = 8192
"""Keys per snapshot message (64 KiB of fixed64), far below the 4 MiB message limit."""
MAX_EVENTS_PER_BATCH = 256
"""Events per incremental message."""
WAIT_SECONDS = 0.5
"""How long one wait for new events lasts; the stream notices a node shutdown within this."""
MAX_SUBSCRIBERS = 8
"""Open streams per node (routers; a few each): each waits for events on a thread of the node's own
small pool, never on the event loop's default executor, which discovery needs."""


async def kv_event_batches(
    log: KvEventLog,
    node_id: str,
    medium: str,
    request: common_pb2.KvEventsRequest,
    stopped: Callable[[], bool],
    executor: ThreadPoolExecutor | None = None,
) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The KvEventBatch messages of one subscription, until `stopped()` (the node shuts down).
    Waits for new events on a thread of `executor` (None: the loop's default executor)."""
    loop = asyncio.get_running_loop()
    resumable = request.node_id == node_id and request.after_seq > 0
    seq: int | None = request.after_seq if resumable else None
    if resumable and log.since(request.after_seq) is not None:
        # the resume is accepted: say so at once, before any new event (a router routes the node as
        # cold until it hears that its entries are current again)
        yield common_pb2.KvEventBatch(node_id=node_id, seq=request.after_seq)
    while not stopped():
        events: list[KvEvent] | None = None if seq is None else log.since(seq)
        if events == [] and seq is not None:
            try:
                events = await loop.run_in_executor(executor, log.wait, seq, WAIT_SECONDS)
            except RuntimeError:  # the interpreter is exiting (no new futures): the stream ends with the node
                return
            if events == []:
                continue
        if events is None:  # first contact, a restart, or a gap: the log no longer holds what follows seq
            snapshot = log.snapshot()
            for batch in _snapshot_batches(snapshot, node_id, medium, request.tiers):
                yield batch
            seq = snapshot.seq
            continue
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            chunk = events[start : start + MAX_EVENTS_PER_BATCH]
            yield common_pb2.KvEventBatch(
                node_id=node_id, seq=chunk[-1].seq, events=[_event_pb(e, medium, request.tiers) for e in chunk]
            )
        seq = events[-1].seq


def _snapshot_batches(
    snapshot: KvSnapshot, node_id: str, pool_medium: str, tiers: bool
) -> list[common_pb2.KvEventBatch]:
    """The snapshot in chunks: the pool's keys, then (if asked) each tier's; the last chunk is done."""
    parts = [(pool_medium, sorted(snapshot.keys))]
    if tiers:
        parts += [(str(m), sorted(keys)) for m, keys in snapshot.tiers.items()]
    batches = [
        common_pb2.KvEventBatch(
            node_id=node_id,
            snapshot=True,
            snapshot_keys=keys[start : start + SNAPSHOT_CHUNK_KEYS],
            snapshot_medium=medium,
            seq=snapshot.seq,
        )
        for medium, keys in parts
        for start in range(0, max(len(keys), 1), SNAPSHOT_CHUNK_KEYS)
    ]
    batches[-1].snapshot_done = True
    return batches


def _event_pb(event: KvEvent, pool_medium: str, tiers: bool) -> common_pb2.KvEvent:
    pool = event.medium is Medium.POOL
    return common_pb2.KvEvent(
        kind=common_pb2.KvEvent.Kind.Name(int(event.kind)),
        seq=event.seq,
        keys=event.keys if pool or tiers else (),
        parent_key=event.parent_key,
        medium=pool_medium if pool else str(event.medium),
    )


class KvEventsServicer:
    """The KvEvents RPC, written once for both node servicers: list it before the generated
    servicer base (whose KvEvents answers UNIMPLEMENTED). Authenticated by the node's interceptor
    like every other call; ends when the node stops."""

    rt: NodeRuntime
    _kv_waiters: ThreadPoolExecutor | None = None
    _kv_subscribers = 0

    async def KvEvents(self, request: common_pb2.KvEventsRequest, context) -> AsyncIterator[common_pb2.KvEventBatch]:
        rt = self.rt
        if self._kv_subscribers >= MAX_SUBSCRIBERS:
            raise TooManySubscribers(f"this node already serves {MAX_SUBSCRIBERS} KvEvents streams")
        if self._kv_waiters is None:
            self._kv_waiters = ThreadPoolExecutor(MAX_SUBSCRIBERS, thread_name_prefix="kv-events")
        medium = "gpu" if rt.engine.kv_pool.tensor.is_cuda else "cpu"
        self._kv_subscribers += 1
        try:
            async for batch in kv_event_batches(
                rt.engine.kv_events, rt.node_id, medium, request, lambda: rt.stopped, self._kv_waiters
            ):
                yield batch
        finally:
            self._kv_subscribers -= 1
