"""Pipeline-parallel baselines: PP+SB (separate batching) and PP+HB (hybrid, chunked prefill).

As in vLLM's pipeline parallelism, the instance runs `num_stages` virtual engines,
each with its own scheduler, its own share (1/num_stages) of the KV blocks and at
most one batch in the pipeline; a virtual engine schedules its next batch only when
its previous one has left the last stage (the decode data dependency).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from pdserve.engine.block_manager import blocks_for
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Batch, BatchItem, Executor, Phase, SimExecutor
from pdserve.tdpipe.feed import RequestFeed
from pdserve.tdpipe.pipeline import KVPool, SimStats
from pdserve.tdpipe.workload import SimRequest


class _VirtualEngine:
    def __init__(self, capacity_blocks: int, block_size: int, waiting: deque[SimRequest]) -> None:
        self.kv = KVPool(capacity_blocks, block_size)
        self.waiting = waiting
        self.running: list[SimRequest] = []


class PPScheduler:
    """PP with separate (prefill-first) batching, or with hybrid chunked-prefill batching.

    Each virtual engine has at most one batch in flight; when it comes back the
    engine retires, preempts and schedules its next batch. The same object runs on
    the simulator (`SimExecutor`, the default) or on real stages (`StageExecutor`).
    """

    def __init__(self, table: CostTable, inst: InstanceConfig, hybrid: bool) -> None:
        self.table, self.inst, self.hybrid = table, inst, hybrid
        self.stats = SimStats("pp+hb" if hybrid else "pp+sb")
        self.ex: Executor = SimExecutor(table, inst.num_stages)

    def run(self, requests: Sequence[SimRequest], executor: Executor | None = None) -> SimStats:
        """Run `requests` to completion on `executor` (default: the simulator)."""
        self.ex = executor or SimExecutor(self.table, self.inst.num_stages)
        self.ex.attach(self.stats)
        n = self.inst.num_stages
        # a RequestFeed (tdpipe.feed) is shared: each engine draws from it as it has room
        feed = requests.split(n) if isinstance(requests, RequestFeed) else None
        queues: list[deque[SimRequest]] = list(feed) if feed else [deque(requests[i::n]) for i in range(n)]
        engines = [_VirtualEngine(self.inst.capacity_blocks // n, self.inst.block_size, q) for q in queues]
        for i, ve in enumerate(engines):
            self._schedule(i, ve, 0.0)
        # Batches leave in the order they entered, so the oldest in flight is the next
        # engine to become free (what the simulator's ready-time heap used to pick).
        while self.ex.inflight:
            done = self.ex.collect()
            ve = engines[done.tag]
            self._complete(ve, done)
            self.stats.kv_samples.append((done.end_ms, sum(e.kv.used for e in engines) / self.inst.capacity_blocks))
            self._schedule(done.tag, ve, done.end_ms)
            if feed:  # an engine that found its feed empty (the window was full) takes new work now
                busy = {b.tag for b in self.ex.inflight}
                for i, idle in enumerate(engines):
                    if i not in busy:
                        self._schedule(i, idle, done.end_ms)
        for ve in engines:
            if ve.waiting:
                r = ve.waiting[0]
                raise ValueError(
                    f"request {r.request_id} ({r.input_len} prompt tokens) does not fit "
                    "in one virtual engine's KV share"
                )
        return self.stats

    def _schedule(self, index: int, ve: _VirtualEngine, t: float) -> None:
        items, phase = self._plan_hybrid(ve) if self.hybrid else self._plan_separate(ve)
        if items:
            self.ex.submit(items, phase, t, tag=index)

    def _admit(self, ve: _VirtualEngine, budget: int, num_seqs: int) -> list[SimRequest]:
        new: list[SimRequest] = []
        while ve.waiting and num_seqs + len(new) < self.inst.max_num_seqs:
            r = ve.waiting[0]
            chunk = r.input_len if not self.hybrid else min(r.input_len, budget)
            # Separate batching runs a prompt longer than the budget alone (a preempted request's
            # prompt grows by what it generated, so it can outgrow the budget it was admitted with).
            oversize_alone = not self.hybrid and not new and budget == self.inst.max_batch_tokens
            if (chunk > budget and not oversize_alone) or chunk <= 0 or not ve.kv.can_admit(r.input_len + 1):
                break
            ve.waiting.popleft()
            ve.kv.reserve(r.input_len + 1)  # whole prompt reserved, and the first token's slot
            budget -= chunk
            new.append(r)
        return new

    def _plan_separate(self, ve: _VirtualEngine) -> tuple[list[BatchItem], str]:
        new = self._admit(ve, self.inst.max_batch_tokens, len(ve.running))
        if new:  # prefill first
            ve.running += new
            return [BatchItem(r, r.input_len, True) for r in new], Phase.PREFILL
        if not ve.running:
            return [], ""
        self._preempt_overflow(ve)
        if not ve.running:  # everything was preempted: start over with prefills
            return self._plan_separate(ve)
        return [BatchItem(r, 1, True) for r in ve.running], Phase.DECODE

    def _plan_hybrid(self, ve: _VirtualEngine) -> tuple[list[BatchItem], str]:
        self._preempt_overflow(ve)
        decoding = [r for r in ve.running if r.num_prefilled == r.input_len]
        budget = self.inst.max_batch_tokens - len(decoding)
        items = [BatchItem(r, 1, True) for r in decoding]
        for r in ve.running:  # continue partially prefilled prompts first
            if r.num_prefilled < r.input_len and budget > 0:
                c = min(budget, r.input_len - r.num_prefilled)
                items.append(BatchItem(r, c, r.num_prefilled + c == r.input_len))
                budget -= c
        for r in self._admit(ve, budget, len(ve.running)):
            c = min(budget, r.input_len)
            items.append(BatchItem(r, c, c == r.input_len))  # the last chunk yields the first token
            budget -= c
            ve.running.append(r)
        return items, Phase.HYBRID

    def _complete(self, ve: _VirtualEngine, done: Batch) -> None:
        """Account a returned batch: decode steps grow the KV, prompt chunks advance, finished requests leave."""
        for item in done.items:
            r = item.request
            if r.num_prefilled == r.input_len:  # a decode step: one more token's KV
                ve.kv.grow(r)
            else:
                r.num_prefilled += item.num_tokens
        live = []
        for r in ve.running:
            if r.num_generated and r.finished:
                ve.kv.release(r)
                r.finish_ms = done.end_ms
                self.ex.finish(r)
            else:
                live.append(r)
        ve.running = live

    def _preempt_overflow(self, ve: _VirtualEngine) -> None:
        """Recompute-preempt the newest requests until the next decode step fits."""

        def need() -> int:
            return sum(
                blocks_for(r.kv_len + 1, ve.kv.block_size) - ve.kv.blocks(r) for r in ve.running if r.num_generated
            )

        while ve.running and ve.kv.used + need() > ve.kv.capacity_blocks:
            victim = ve.running.pop()
            ve.kv.used -= (
                blocks_for(victim.input_len + 1, ve.kv.block_size) if not victim.num_generated else ve.kv.blocks(victim)
            )
            self.ex.free(victim)
            victim.preempt()
            ve.waiting.appendleft(victim)
            self.stats.num_preemptions += 1
