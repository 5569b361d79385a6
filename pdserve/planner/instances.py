"""The simulated instances: a prefill instance, and a decode instance that may also prefill (colocated).

Each is a small state machine driven by an `EventLoop`: requests are submitted, a batch runs for
the profile's time at its token count, and finished work is handed on through a callback. Times
are in seconds; the profile's tables are in ms.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence, TypeVar

from pdserve.tdpipe.cost_table import CostTable


class EventLoop:
    """A time-ordered queue of callbacks; ties run in the order they were scheduled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0

    def at(self, time_s: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (time_s, self._seq, fn))
        self._seq += 1

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until none is left or `stop()` says so."""
        while self._heap and not stop():
            time_s, _, fn = heapq.heappop(self._heap)
            fn(time_s)


@dataclass(eq=False)
class SimRequest:
    """One request's times as the simulation advances it (seconds; -1 until known)."""

    arrival: float
    input_len: int
    output_len: int
    first_token: float = -1.0
    finish: float = -1.0
    prefill_left: int = 0
    """Prompt tokens a colocated instance has still to prefill."""

    @property
    def kv_need(self) -> int:
        """KV tokens reserved at admission: the whole prompt and output (no preemption is modelled)."""
        return self.input_len + self.output_len


Done = Callable[[SimRequest, float], None]


class Instance(Protocol):
    """What the router sees of an instance: its load, and a way in."""

    load: int

    def submit(self, req: SimRequest, now: float) -> None: ...


AnyInstance = TypeVar("AnyInstance", bound=Instance)


def least_loaded(instances: Sequence[AnyInstance]) -> AnyInstance:
    """The instance a request goes to (the first of equals)."""
    return min(instances, key=lambda i: i.load)


class PrefillInstance:
    """Prefill only: FCFS batches of whole prompts up to `max_batch_tokens` (a longer prompt runs alone)."""

    def __init__(self, loop: EventLoop, table: CostTable, max_batch_tokens: int, on_prefilled: Done) -> None:
        self.loop, self.table, self.budget, self.on_prefilled = loop, table, max_batch_tokens, on_prefilled
        self.queue: deque[SimRequest] = deque()
        self.load = 0
        """Prompt tokens queued or in the running batch (the router sends to the least loaded)."""
        self.busy = False

    def submit(self, req: SimRequest, now: float) -> None:
        self.queue.append(req)
        self.load += req.input_len
        if not self.busy:
            self._start(now)

    def _start(self, now: float) -> None:
        batch: list[SimRequest] = []
        tokens = 0
        while self.queue and (not batch or tokens + self.queue[0].input_len <= self.budget):
            req = self.queue.popleft()
            batch.append(req)
            tokens += req.input_len
        self.busy = True
        self.loop.at(now + self.table.forward_ms(tokens) / 1000.0, lambda t: self._finish(t, batch, tokens))

    def _finish(self, now: float, batch: list[SimRequest], tokens: int) -> None:
        self.busy = False
        self.load -= tokens
        for req in batch:
            self.on_prefilled(req, now)
        if self.queue:
            self._start(now)


class Run(NamedTuple):
    """Steps over one batch: the k-th (from 0) takes `first_s + growth_s * k` seconds, since each
    step's sequences read one more KV token each than the step before's (`growth_s` 0 when the
    profile has no KV slope)."""

    start: float
    first_s: float
    growth_s: float
    steps: int

    def end(self, n: int) -> float:
        """When the n-th step ends."""
        return self.start + n * self.first_s + self.growth_s * n * (n - 1) / 2

    def steps_by(self, now: float) -> int:
        """The steps done once the one under way at `now` ends (at least 1)."""
        elapsed = now - self.start
        if self.growth_s > 0:  # the root of end(n) = now, then nudged to the exact step
            b = self.first_s - self.growth_s / 2
            n = math.ceil((-b + math.sqrt(b * b + 2 * self.growth_s * elapsed)) / self.growth_s - 1e-9)
        else:
            n = math.ceil(elapsed / self.first_s - 1e-9)
        n = max(1, n)
        while n > 1 and self.end(n - 1) >= now:
            n -= 1
        while self.end(n) < now - 1e-12:
            n += 1
        return n


class DecodeInstance:
    """Continuous batching: every step runs one token of each admitted request, priced at the
    batch's token count, plus, where the profile measured it, the KV its sequences read beyond the
    length the table was timed at (`PipelineOverheads.decode_kv_ms`). Admission is FCFS while the KV
    fits (`kv_tokens`; a request too big for it runs alone). `colocated` (or `submit(prefill=True)`
    for one request): submitted requests prefill here too, in chunks of the step's token budget left
    after the decode tokens (vLLM's chunked prefill); the first token comes at the end of the step
    that runs the last chunk.

    Between admissions and finishes a batch does not change, so a run of steps is one event; a
    request submitted during it joins at the next step boundary (the run is cut there)."""

    def __init__(
        self,
        loop: EventLoop,
        table: CostTable,
        kv_tokens: int,
        max_batch_tokens: int,
        colocated: bool,
        on_finish: Done,
    ) -> None:
        self.loop, self.table, self.kv_tokens, self.budget = loop, table, kv_tokens, max_batch_tokens
        self.colocated, self.on_finish = colocated, on_finish
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []
        """Heap of (the step count at which the request's last token is out, seq, request)."""
        self.steps = 0
        self.kv_used = 0
        self.load = 0
        """KV tokens reserved or waiting (the router sends to the least loaded)."""
        self.local_prefill = 0
        """Prompt tokens this instance is to prefill itself and has not finished (the router's offload
        rule weighs them)."""
        self._seq = 0
        self._kv_base = 0
        """The decoding requests' KV tokens at step count S are `_kv_base + len(decoding) * S`."""
        over = table.overheads
        self._kv_ms = over.decode_kv_ms[0] if len(over.decode_kv_ms) == 1 else 0.0
        self._kv_context = over.decode_context
        self._run = Run(0.0, 0.0, 0.0, 0)
        self._chunks: list[tuple[SimRequest, int]] = []
        self._version = 0
        """Bumped when a run is cut or replaced: the end event of the old one is then ignored."""
        self.busy = False

    def submit(self, req: SimRequest, now: float, prefill: bool = False) -> None:
        """Take `req`; it prefills here if this instance is colocated or `prefill` says so (a
        disaggregated shape's decode instance prefilling a short or offloaded prompt itself)."""
        if self.colocated or prefill:
            req.prefill_left = req.input_len
            self.local_prefill += req.input_len
        else:
            assert req.output_len > 1, "a one-token request ends at its prefill"
        self.waiting.append(req)
        self.load += req.kv_need
        if not self.busy:
            self._plan(now)
            return
        done = self._run.steps_by(now)  # the step under way finishes first
        if done < self._run.steps:
            self._run = self._run._replace(steps=done)
            self._schedule_end()

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            if self.kv_used + req.kv_need > self.kv_tokens and (self.decoding or self.prefilling):
                return
            self.waiting.popleft()
            self.kv_used += req.kv_need
            if req.prefill_left > 0:
                self.prefilling.append(req)
            else:
                self._decode(req)

    def _decode(self, req: SimRequest) -> None:
        """Its first token is out; the next `output_len - 1` steps make the rest."""
        heapq.heappush(self.decoding, (self.steps + req.output_len - 1, self._seq, req))
        self._seq += 1
        self._kv_base += req.input_len + 1 - self.steps  # its KV: the prompt and first token, +1 a step

    def _step_s(self, tokens: int) -> tuple[float, float]:
        """(first step's seconds, growth per step) of a run over `tokens` tokens at the current batch."""
        table_ms = self.table.forward_ms(tokens)
        batch = len(self.decoding)
        kv = self._kv_base + batch * self.steps
        # a linear KV slope extrapolated far below its context could price a step at nothing: floor it
        first_ms = max(0.1 * table_ms, table_ms + self._kv_ms * (kv - batch * self._kv_context))
        return first_ms / 1000.0, self._kv_ms * batch / 1000.0

    def _plan(self, now: float) -> None:
        self._admit()
        self._chunks = []
        if self.prefilling:  # one step at a time while prompts are chunked in
            room = max(0, self.budget - len(self.decoding))
            for req in self.prefilling:
                if room <= 0:
                    break
                chunk = min(req.prefill_left, room)
                self._chunks.append((req, chunk))
                room -= chunk
            tokens, steps = len(self.decoding) + sum(c for _, c in self._chunks), 1
        elif self.decoding:  # until the first request finishes
            tokens, steps = len(self.decoding), self.decoding[0][0] - self.steps
        else:
            self.busy = False
            return
        self.busy = True
        self._run = Run(now, *self._step_s(tokens), steps)
        self._schedule_end()

    def _schedule_end(self) -> None:
        self._version += 1
        version = self._version
        self.loop.at(self._run.end(self._run.steps), lambda t: self._end(t, version))

    def _end(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self.steps += self._run.steps
        while self.decoding and self.decoding[0][0] <= self.steps:
            done_at, _, req = heapq.heappop(self.decoding)
            self._kv_base -= req.input_len + 1 - (done_at - req.output_len + 1)
            self._finish(req, now)
        for req, chunk in self._chunks:
            req.prefill_left -= chunk
            if req.prefill_left == 0:
                self.prefilling.remove(req)
                self.local_prefill -= req.input_len
                req.first_token = now
                if req.output_len > 1:
                    self._decode(req)
                else:
                    self._finish(req, now)
        self._plan(now)

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finish = now
        self.kv_used -= req.kv_need
        self.load -= req.kv_need
        self.on_finish(req, now)
