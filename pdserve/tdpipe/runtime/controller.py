"""The central controller (rank 0): requests, block tables and the policy live here; stages only compute.

The scheduling policy is one of the simulator's own objects (`tdpipe.simulator.make_policy`):
TD-Pipe, PP+SB or PP+HB. It drives the stage processes through `StageExecutor`, the
runtime implementation of `tdpipe.executor.Executor`; the simulator drives the same
policy object through `SimExecutor`. Per batch, every stage receives one small control
message (a `ForwardBatch` whose block tables the controller owns); the last stage sends
back one token per sampled sequence. As many batches are in flight as the policy submits
(TD-Pipe keeps one decode batch per stage in the pipeline).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from pdserve.engine.block_manager import BlockManager, blocks_for
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tdpipe.executor import Batch, Executor
from pdserve.tdpipe.runtime.last_stage import NO_TOKEN, STOP_ROW, TOKEN_ROW, StageMessage, needs_announcing
from pdserve.tdpipe.runtime.live_stats import PipelineGauge
from pdserve.tdpipe.runtime.wire import Outbox, recv_frame, send_frame
from pdserve.tdpipe.workload import SimRequest


class StageFailure(RuntimeError):
    """A stage process died or stopped answering; the job must stop."""


@dataclass
class _Answer:
    """The last stage's answer to one batch that is not held, which also carries the tokens of the
    held batches submitted just before it (their columns first)."""

    tokens: torch.Tensor
    work: Any
    rows: tuple[list[int], list[int]] | None = None
    """(token ids, stop flags) as lists once received: read once, whichever of its batches is
    collected first (every held batch of a phase shares this answer)."""


class PipeRequest(SimRequest):
    """A real request: the policy sees the `SimRequest` fields, the executor the token ids.

    `input_len`, `output_len` and `num_generated` follow the simulator's meaning
    (recompute preemption folds generated tokens into the prompt); `output_ids` keeps
    every token generated so far, which is what the job returns.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        predicted_len: int | None = None,
        params: SamplingParams | None = None,
    ) -> None:
        if not prompt_ids or max_tokens <= 0:
            raise ValueError(f"request {request_id}: needs a prompt and max_tokens > 0")
        super().__init__(
            request_id,
            len(prompt_ids),
            max_tokens,
            predicted_len if predicted_len is not None else max_tokens,
        )
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.params = params
        """How the last stage samples this request; None (or greedy params) is greedy."""
        self.output_ids: list[int] = []
        self.stopped = False
        """The last stage saw the last token complete one of `params.stop` (ends the request)."""
        self.block_ids: list[int] = []
        self.num_computed = 0
        """Positions sent to the stages: their KV is in the pools once the batch that carries them has
        passed (stages run batches in order, so a later chunk or step of the request sees it)."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return (
            super().finished or self.stopped or (bool(self.output_ids) and self.output_ids[-1] in self.stop_token_ids)
        )

    def preempt(self) -> None:
        super().preempt()
        self.num_computed = 0  # recompute: the executor already freed the blocks


class StageExecutor(Executor):
    """Runs a policy's batches on stage ranks 1..num_stages (rank 0 is this process)."""

    def __init__(
        self,
        num_stages: int,
        num_kv_blocks: int,
        block_size: int,
        stage_procs: list[subprocess.Popen] | None = None,
        on_finish: Callable[[PipeRequest], None] | None = None,
    ) -> None:
        super().__init__()
        self.num_stages, self.block_size = num_stages, block_size
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        """The stages' KV block ids: the engine's allocator (each stage's pool has the same ids)."""
        self.stage_procs = stage_procs or []
        self.on_finish = on_finish
        self.outbox = Outbox()
        self.t0 = time.perf_counter()
        self._announced: set[str] = set()
        self._forget: list[str] = []
        self._held: list[Batch] = []
        """Held batches (`Batch.hold`) submitted since the last batch that is not held."""
        self.gauge = PipelineGauge(num_stages)
        """Live phase, tokens and bubble estimate (progress and metrics read it from other threads)."""

    def _start(self, batch: Batch) -> None:
        ids, query, context, tables = [], [], [], []
        for item in batch.items:
            r = item.request
            assert isinstance(r, PipeRequest)
            end = r.num_computed + item.num_tokens
            need = blocks_for(end, self.block_size) - len(r.block_ids)
            if need > self.blocks.num_free_blocks:  # the policy's accounting must prevent this
                raise RuntimeError(
                    f"policy over-committed the KV pool: {r.request_id} needs {need} blocks, "
                    f"{self.blocks.num_free_blocks} free"
                )
            r.block_ids += [self.blocks.append_block() for _ in range(need)]
            ids += r.all_ids[r.num_computed : end]
            query.append(item.num_tokens)
            context.append(end)
            tables.append(list(r.block_ids))
            r.num_computed = end  # now, not when it returns: TD-Pipe has a prompt's chunks in flight together
        fb = ForwardBatch(
            request_ids=[str(i.request.request_id) for i in batch.items],
            input_ids=ids,
            query_lens=query,
            context_lens=context,
            block_tables=tables,
            sample_mask=[i.sample for i in batch.items],
        )
        new_params = {}
        for item in batch.items:
            r = item.request
            assert isinstance(r, PipeRequest)
            if r.params is not None and needs_announcing(r.params) and r.request_id not in self._announced:
                self._announced.add(r.request_id)  # type: ignore[arg-type]
                new_params[str(r.request_id)] = (r.params, r.prompt_ids)
        msg = StageMessage(fb, new_params, tuple(self._forget), hold=batch.hold)
        self._forget.clear()
        send_frame(self.outbox, msg, range(1, self.num_stages + 1))
        if not self.gauge.batches_done and not self.gauge.in_flight:
            self.gauge.start()  # the first batch: the stages are up, the pipeline starts filling
        self.gauge.on_submit(batch.phase)
        if batch.hold:  # answered with the next batch that is not held
            self._held.append(batch)
            return
        held, self._held = self._held, []
        columns: list[list[int | None]] = []  # per held batch, each item's column (None: samples nothing)
        first = 0  # the held batches' sampled rows come first, in order
        for b in held:
            columns.append([])
            for item in b.items:
                columns[-1].append(first if item.sample else None)
                first += item.sample
        tokens = torch.empty((2, first + len(batch.items)), dtype=torch.long)  # last_stage: tokens, stop flags
        answer = _Answer(tokens, dist.irecv(tokens, self.num_stages))
        for b, cols in zip(held, columns):
            b.handle = (answer, cols)
        batch.handle = (answer, list(range(first, first + len(batch.items))))

    def _complete(self, batch: Batch) -> None:
        """Wait for the batch's tokens. A dead stage closes its connections, and the error
        travels down the pipeline to this receive (gloo cannot poll a receive)."""
        if batch.handle is None:
            raise RuntimeError("a held batch was collected before the batch that answers for it was submitted")
        answer, columns = batch.handle
        if answer.rows is None:
            try:
                answer.work.wait()
            except RuntimeError as e:
                dead = [
                    f"stage {k} (pid {p.pid}) exited with code {p.poll()}"
                    for k, p in enumerate(self.stage_procs)
                    if p.poll() is not None
                ]
                raise StageFailure("; ".join(dead) or f"pipeline stage failed: {e}") from e
            answer.rows = (answer.tokens[TOKEN_ROW].tolist(), answer.tokens[STOP_ROW].tolist())
        batch.end_ms = (time.perf_counter() - self.t0) * 1000.0
        tokens, stops = answer.rows
        for item, col in zip(batch.items, columns, strict=True):
            r = item.request
            assert isinstance(r, PipeRequest)
            if item.sample:
                if col is None or tokens[col] == NO_TOKEN:
                    raise StageFailure(f"the last stage sampled nothing for {r.request_id}")
                r.output_ids.append(int(tokens[col]))
                r.stopped = bool(stops[col])
        self.gauge.on_complete(sum(1 for item in batch.items if item.sample))

    def free(self, request: SimRequest) -> None:
        assert isinstance(request, PipeRequest)
        self.blocks.free_blocks(request.block_ids)
        request.block_ids = []

    def finish(self, request: SimRequest) -> None:
        self.free(request)
        if request.request_id in self._announced:
            self._announced.discard(request.request_id)
            self._forget.append(str(request.request_id))
        if self.on_finish is not None:
            self.on_finish(request)  # type: ignore[arg-type]

    def shutdown(self) -> list[list[tuple[float, float, int, str]]]:
        """Stop the stages; returns each stage's timeline spans."""
        send_frame(self.outbox, None, range(1, self.num_stages + 1))
        timelines: list = [recv_frame(stage + 1) for stage in range(self.num_stages)]
        self.outbox.flush()
        return timelines
