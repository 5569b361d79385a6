"""The central controller: owns requests, block tables and the schedule; stages only compute.

Schedule (a runtime-side phase alternation, not yet the shared TD-Pipe policy
objects of `tdpipe/td_scheduler.py`): a prefill phase admits waiting prompts
while their blocks fit, in batches of at most `max_batch_tokens`; then a decode
phase splits the resident requests into `num_stages` batches, so as many
batches are in flight as there are stages. A request that cannot get a block to
grow is recompute-preempted (its blocks freed, prompt + generated re-queued).
"""

from __future__ import annotations

import subprocess
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.block_manager import BlockManager
from engine.forward_batch import ForwardBatch
from tdpipe.runtime.wire import Outbox, recv_object


class StageFailure(RuntimeError):
    """A stage process died or stopped answering; the job must stop."""


@dataclass
class PipeRequest:
    """One request as the controller tracks it."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is in the stages' pools."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_tokens or (
            bool(self.output_ids) and self.output_ids[-1] in self.stop_token_ids)


@dataclass
class RunStats:
    """Counters the job summary reports."""

    phase_switches: int = 0
    preemptions: int = 0
    output_tokens: int = 0


class PipelineController:
    """Rank 0: drives `num_stages` stage ranks (1..num_stages) batch by batch."""

    def __init__(self, num_stages: int, num_kv_blocks: int, block_size: int, max_batch_tokens: int = 2048,
                 stage_procs: list[subprocess.Popen] | None = None) -> None:
        self.num_stages = num_stages
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        self.max_batch_tokens = max_batch_tokens
        self.stage_procs = stage_procs or []
        self.outbox = Outbox()
        self.stats = RunStats()
        self.inflight: deque[tuple[list[PipeRequest], torch.Tensor, object]] = deque()
        self.phase = "starting"
        """"prefill" or "decode" while running: read by `pdserve batch`'s progress bar."""

    def run(self, requests: list[PipeRequest], on_finish=None) -> None:
        """Generate every request to completion; `on_finish(req)` is called as each one ends."""
        waiting: deque[PipeRequest] = deque(requests)
        resident: list[PipeRequest] = []
        while waiting or resident:
            self.stats.phase_switches += 1
            self.phase = "prefill"
            resident += self._prefill_phase(waiting, bool(resident), on_finish)
            if not resident and waiting:
                r = waiting[0]
                raise ValueError(f"request {r.request_id} ({len(r.all_ids)} tokens) does not fit the KV capacity")
            self.stats.phase_switches += 1
            self.phase = "decode"
            resident = self._decode_phase(resident, waiting, on_finish)

    def shutdown(self) -> list[list[tuple[float, float, int, str]]]:
        """Stop the stages; returns each stage's timeline spans."""
        for stage in range(self.num_stages):
            self.outbox.send_object(None, stage + 1)
        timelines = [recv_object(stage + 1) for stage in range(self.num_stages)]
        self.outbox.flush()
        return timelines

    def _prefill_phase(self, waiting: deque[PipeRequest], has_resident: bool, on_finish) -> list[PipeRequest]:
        admitted: list[PipeRequest] = []
        batch, tokens = [], 0
        while waiting:
            r = waiting[0]
            # keep one block per resident request free so the first decode step can grow
            if not self.blocks.can_allocate(r.all_ids, len(r.all_ids) + 1, reserve=len(admitted)):
                break
            waiting.popleft()
            r.block_ids, _ = self.blocks.allocate(r.all_ids, len(r.all_ids))
            if batch and tokens + len(r.all_ids) > self.max_batch_tokens:
                self._submit(batch)
                batch, tokens = [], 0
            batch.append(r)
            tokens += len(r.all_ids)
            admitted.append(r)
        if batch:
            self._submit(batch)
        while self.inflight:
            self._collect()
        return self._retire(admitted, on_finish)

    def _decode_phase(self, resident: list[PipeRequest], waiting: deque[PipeRequest], on_finish) -> list[PipeRequest]:
        n = self.num_stages
        resident = self._grow_or_preempt(resident, waiting)
        num_start = len(resident)
        for i in range(n):
            if resident[i::n]:
                self._submit(resident[i::n])
        live: list[PipeRequest] = []
        while self.inflight:
            batch = self._collect()
            remaining = self._retire(batch, on_finish)
            # Switch to prefill once half the phase's requests finished and prompts wait:
            # the pipeline then drains (batches already in flight complete).
            if waiting and len(remaining) + sum(len(b) for b, _, _ in self.inflight) <= num_start // 2:
                live += remaining
                continue
            remaining = self._grow_or_preempt(remaining, waiting)
            if remaining:
                self._submit(remaining)
        return live

    def _grow_or_preempt(self, batch: list[PipeRequest], waiting: deque[PipeRequest]) -> list[PipeRequest]:
        kept = []
        for r in batch:
            if self.blocks.blocks_for(r.num_computed + 1) > len(r.block_ids):
                if self.blocks.num_free_blocks == 0:
                    self.blocks.free_blocks(r.block_ids)
                    r.block_ids, r.num_computed = [], 0
                    waiting.appendleft(r)  # recompute prompt + generated later
                    self.stats.preemptions += 1
                    continue
                r.block_ids.append(self.blocks.append_block())
            kept.append(r)
        return kept

    def _submit(self, batch: list[PipeRequest]) -> None:
        """Send one batch's control message to every stage and post the receive of its tokens."""
        new = [r.all_ids[r.num_computed:] for r in batch]
        fb = ForwardBatch(request_ids=[r.request_id for r in batch], input_ids=[t for ids in new for t in ids],
                          query_lens=[len(ids) for ids in new], context_lens=[len(r.all_ids) for r in batch],
                          block_tables=[list(r.block_ids) for r in batch], sample_mask=[True] * len(batch))
        for stage in range(self.num_stages):
            self.outbox.send_object(fb, stage + 1)
        tokens = torch.empty(len(batch), dtype=torch.long)
        self.inflight.append((batch, tokens, dist.irecv(tokens, self.num_stages)))

    def _collect(self) -> list[PipeRequest]:
        """Wait for the oldest batch's tokens. A dead stage closes its connections, and the
        error travels down the pipeline to this receive (gloo cannot poll a receive)."""
        batch, tokens, work = self.inflight.popleft()
        try:
            work.wait()
        except RuntimeError as e:
            dead = [f"stage {k} (pid {p.pid}) exited with code {p.poll()}"
                    for k, p in enumerate(self.stage_procs) if p.poll() is not None]
            raise StageFailure("; ".join(dead) or f"pipeline stage failed: {e}") from e
        for r, tok in zip(batch, tokens.tolist()):
            r.num_computed = len(r.all_ids)
            r.output_ids.append(int(tok))
        self.stats.output_tokens += len(batch)
        return batch

    def _retire(self, batch: list[PipeRequest], on_finish) -> list[PipeRequest]:
        live = []
        for r in batch:
            if r.finished:
                self.blocks.free_blocks(r.block_ids)
                r.block_ids = []
                if on_finish:
                    on_finish(r)
            else:
                live.append(r)
        return live
