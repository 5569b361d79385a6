"""A node's requests: one record per request (`NodeRequest`) in one registry (`NodeRequests`).

Everything a node keeps about a request lives on its record, and the record lives exactly as long
as the request's RPC (`NodeRuntime.request`):
- its output queue, to which the engine thread's step outputs are delivered;
- its clock (vLLM's per-request series);
- the engine's `Request`, whose `status` is the request's one status machine (WAITING,
  WAITING_FOR_REMOTE_KV, RUNNING, PREEMPTED, FINISHED_*), written by the engine thread only;
- what its KV transfer holds on this node: the CacheStore session a decode node receives the
  prompt's KV into, the transfers a prefill node sends it on.

One cleanup path ends every request: the record's end callback runs once, however the RPC ended,
and only then is the record removed. The CacheStore's own session table (looked up by the
listener when a writer connects) holds nothing a record has not opened and does not close.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from pdserve.engine.request import Request, RequestStatus, StepOutput
from pdserve.node_runtime.node_metrics import NodeMetrics
from pdserve.node_runtime.vllm_metrics import RequestClock

if TYPE_CHECKING:
    from pdserve.cachestore import Session, Transfer

_DEAD = object()


class EngineDeadError(RuntimeError):
    """The engine thread has died; no request on this node can make progress."""


class Subscription(asyncio.Queue):
    """A request's output queue; after the engine dies, `get()` raises instead of waiting forever."""

    async def get(self):
        item = await super().get()
        if item is _DEAD:
            self.put_nowait(_DEAD)  # every later get() raises too
            raise EngineDeadError("the engine thread of this node died")
        return item

    def fail(self) -> None:
        """The engine died: the next `get()` raises EngineDeadError."""
        self.put_nowait(_DEAD)


@dataclass(eq=False)
class NodeRequest:
    """One request's time on a node: its output queue, its clock, the engine's record of it, the KV
    transfer state this node holds for it, and whether it ended with its result (else its end
    callback aborts it)."""

    request_id: str
    queue: Subscription
    clock: RequestClock
    """Observes the request's queue time, tokens and end as its outputs arrive."""
    metrics: NodeMetrics
    finished: bool = False
    ending: bool = False
    """Set when the RPC is over and the end callback runs: no more outputs are queued for it."""
    engine_request: Request | None = None
    """The engine's record once admitted (`NodeRuntime.admit`); only the engine thread writes it."""
    session: Session | None = None
    """Decode node: the CacheStore session over the blocks a prefill node fills; open while KV may
    arrive, then closed and kept until no writer is inside its blocks (fenced)."""
    rank_sessions: bool = False
    """Decode node with tensor-parallel ranks: sessions are open on ranks 1.. too."""
    transfers: list[Transfer] = field(default_factory=list)
    """Prefill node: the request's transfers, one per decode rank this node writes heads to."""
    first_block: int = 0
    """Prefill node: index of the first block the transfers write (the decode node holds those before)."""

    @property
    def started(self) -> float:
        """When the node admitted the request (monotonic seconds)."""
        return self.clock.started

    @property
    def status(self) -> RequestStatus:
        """Where the request is in the engine's status machine (WAITING until admitted)."""
        return self.engine_request.status if self.engine_request is not None else RequestStatus.WAITING

    @property
    def age(self) -> float:
        return time.monotonic() - self.started

    async def next_output(self) -> StepOutput:
        """The request's next step output (EngineDeadError if the engine died), observed on its way:
        the wait before it first ran, its new tokens, and how it ended."""
        out = await self.queue.get()
        if out.queue_seconds is not None:
            self.clock.queued(out.queue_seconds)
        self.clock.tokens(len(out.new_token_ids))
        if out.finished:
            self.metrics.count_prefix_lookup(out.num_prompt_tokens, out.num_cached_tokens)
            self.clock.finish(out.finish_reason, out.num_output_tokens)
        return out


class NodeRequests:
    """The node's one registry of requests, by id. Written only by the event loop; the engine
    thread reads it (`get`) to find a prefill request's transfers, which a dict lookup makes safe."""

    def __init__(self) -> None:
        self._by_id: dict[str, NodeRequest] = {}

    def add(self, record: NodeRequest) -> None:
        """Register a new request; ValueError (INVALID_ARGUMENT) if its id is already in flight here:
        a second request must never take over the first one's outputs or end it."""
        if record.request_id in self._by_id:
            raise ValueError(f"request_id {record.request_id!r} is already in flight on this node")
        self._by_id[record.request_id] = record

    def remove(self, record: NodeRequest) -> None:
        if self._by_id.get(record.request_id) is record:
            del self._by_id[record.request_id]

    def get(self, request_id: str) -> NodeRequest | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[NodeRequest]:
        return iter(list(self._by_id.values()))

    def deliver(self, outputs: list[StepOutput]) -> None:
        """In the event loop: queue each step output for its request (dropped once it is ending)."""
        for out in outputs:
            record = self._by_id.get(out.request_id)
            if record is not None and not record.ending:
                record.queue.put_nowait(out)

    def engine_died(self) -> None:
        """In the event loop: every request's next output raises EngineDeadError."""
        for record in self._by_id.values():
            record.queue.fail()
