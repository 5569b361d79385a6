"""The executor interface: how a scheduling policy gets the batches it decides run.

A policy (`TDPipeScheduler`, `PPScheduler`) decides *what* runs: which requests
join a batch, with how many new tokens, when to switch phase, whom to preempt.
An executor runs those batches. `SimExecutor` runs them on the discrete-event
pipeline model (a cost table); the runtime's `StageExecutor`
(tdpipe/runtime/controller.py) sends them to real stage processes. The decision
code is the same object in both; only the executor differs.

Contract (both executors honour it, the policies rely on it):

- `submit` queues one batch; batches leave the pipeline in the order they were
  submitted (a pipeline of stages is a flow shop).
- `collect` waits for the oldest batch in flight and applies its results: every
  item with `sample=True` gained one generated token (`num_generated += 1`).
- `free(req)` gives back the KV memory of a preempted request, `finish(req)` the
  memory of a finished one (and reports it). The policy's own `KVPool`
  accounting decides *whether* memory is available; the executor only holds the
  real blocks (the simulator has none).
- Every submitted batch is appended to `decisions`, the decision log: the same
  policy on the same requests must produce the same log on either executor.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.pipeline import Pipeline, SimStats
from pdserve.tdpipe.workload import SimRequest

Decision = tuple[str, tuple[tuple[str, int, bool], ...]]
"""(phase, ((request id, new tokens, samples a token), ...)) of one submitted batch."""


@dataclass(frozen=True)
class BatchItem:
    """One request's share of a batch."""

    request: SimRequest
    num_tokens: int
    """New tokens this batch computes for the request: a whole prompt, a prompt chunk, or 1 (decode)."""
    sample: bool
    """Whether the batch yields a token for the request (decode, or the last chunk of its prompt)."""


class Phase(enum.StrEnum):
    """What a batch computes (members equal their strings: stats and timelines carry the plain name)."""

    PREFILL = "prefill"
    DECODE = "decode"
    HYBRID = "hybrid"
    """Chunked prefill mixed with decode (pp-hb)."""


@dataclass
class Batch:
    """A submitted batch and, once collected, when it left the pipeline."""

    items: list[BatchItem]
    phase: str
    """A Phase."""
    ready_ms: float
    """Earliest start the policy's model of time allows (the simulator honours it; real stages
    start when their input arrives)."""
    tag: Any = None
    """Opaque to the executor, returned with the batch (PP: the virtual engine's index)."""
    hold: bool = False
    """Its sampled tokens may come back with the next batch submitted that is not held (the runtime
    then reads the LM head's weights once for both: `StageMessage.hold`); the policy submits that
    batch before it collects this one. The simulator ignores it."""
    end_ms: float = -1.0
    """When the batch left the last stage, ms since the executor started."""
    handle: Any = field(default=None, repr=False)
    """Executor-private state of the batch in flight."""

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


class Executor(ABC):
    """Runs a policy's batches in submission order (see the module docstring for the contract)."""

    def __init__(self) -> None:
        self.inflight: deque[Batch] = deque()
        self.decisions: list[Decision] = []
        self.stats = SimStats("unbound")

    def attach(self, stats: SimStats) -> None:
        """Bind the policy's stats (output tokens, makespan, busy time are counted here)."""
        self.stats = stats

    def submit(
        self, items: list[BatchItem], phase: str, ready_ms: float = 0.0, tag: Any = None, hold: bool = False
    ) -> None:
        """Queue one batch (non-empty) behind those in flight (`hold`: `Batch.hold`)."""
        if not items:
            raise ValueError("a batch needs at least one item")
        batch = Batch(items, phase, ready_ms, tag, hold=hold)
        self.decisions.append((phase, tuple((str(i.request.request_id), i.num_tokens, i.sample) for i in items)))
        self._start(batch)
        self.inflight.append(batch)

    def collect(self) -> Batch:
        """Wait for the oldest batch in flight; its sampled requests each gained one token."""
        batch = self.inflight.popleft()
        self._complete(batch)
        for item in batch.items:
            if item.sample:
                item.request.num_generated += 1
                self.stats.output_tokens += 1
        self.stats.makespan_ms = max(self.stats.makespan_ms, batch.end_ms)
        return batch

    def free(self, request: SimRequest) -> None:
        """A preempted request's KV memory goes back (none in the simulator)."""

    def finish(self, request: SimRequest) -> None:
        """A finished request leaves: its KV memory goes back and it is reported."""
        self.free(request)

    @abstractmethod
    def _start(self, batch: Batch) -> None:
        """Start running `batch` (behind the batches already in flight)."""

    @abstractmethod
    def _complete(self, batch: Batch) -> None:
        """Wait until `batch` left the pipeline; set `batch.end_ms` and apply its outputs
        other than the generated-token count (sampled ids, computed positions)."""


class SimExecutor(Executor):
    """The discrete-event executor: each batch costs the cost table's time on every stage."""

    def __init__(self, table: CostTable, num_stages: int) -> None:
        super().__init__()
        self.table, self.num_stages = table, num_stages
        self.pipe: Pipeline | None = None

    def attach(self, stats: SimStats) -> None:
        super().attach(stats)
        self.pipe = Pipeline(self.table, self.num_stages, stats)

    def _start(self, batch: Batch) -> None:
        if self.pipe is None:
            raise RuntimeError("attach() the policy's stats before submitting")
        # A flow shop with FIFO order: the exit time is known at entry.
        decode = all(item.num_tokens == 1 for item in batch.items)
        kv_tokens = sum(item.request.kv_len for item in batch.items) if decode else None  # what a step reads
        batch.end_ms = self.pipe.submit(batch.num_tokens, batch.ready_ms, decode, kv_tokens)

    def _complete(self, batch: Batch) -> None:
        pass  # end_ms was computed at submission
