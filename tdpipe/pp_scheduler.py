"""Pipeline-parallel baselines: PP+SB (separate batching) and PP+HB (hybrid, chunked prefill).

As in vLLM's pipeline parallelism, the instance runs `num_stages` virtual engines,
each with its own scheduler, its own share (1/num_stages) of the KV blocks and at
most one batch in the pipeline; a virtual engine schedules its next batch only when
its previous one has left the last stage (the decode data dependency).
"""

from __future__ import annotations

import heapq
from collections import deque

from tdpipe.config import InstanceConfig
from tdpipe.cost_table import CostTable
from tdpipe.pipeline import KVPool, Pipeline, SimStats
from tdpipe.workload import SimRequest


class _VirtualEngine:
    def __init__(self, capacity_blocks: int, block_size: int, requests: list[SimRequest]) -> None:
        self.kv = KVPool(capacity_blocks, block_size)
        self.waiting: deque[SimRequest] = deque(requests)
        self.running: list[SimRequest] = []


class PPScheduler:
    """PP with separate (prefill-first) batching, or with hybrid chunked-prefill batching."""

    def __init__(self, table: CostTable, inst: InstanceConfig, hybrid: bool) -> None:
        self.table, self.inst, self.hybrid = table, inst, hybrid
        self.stats = SimStats("pp+hb" if hybrid else "pp+sb")
        self.pipe = Pipeline(table, inst.num_stages, self.stats)

    def run(self, requests: list[SimRequest]) -> SimStats:
        n = self.inst.num_stages
        engines = [_VirtualEngine(self.inst.capacity_blocks // n, self.inst.block_size, requests[i::n])
                   for i in range(n)]
        ready = [(0.0, i) for i in range(n)]  # (time the engine may schedule, engine index)
        while ready:
            t, i = heapq.heappop(ready)
            ve = engines[i]
            end = self._step_hybrid(ve, t) if self.hybrid else self._step_separate(ve, t)
            if end is not None:
                self.stats.kv_samples.append((end, sum(e.kv.used for e in engines) / self.inst.capacity_blocks))
                heapq.heappush(ready, (end, i))
            elif ve.waiting:
                r = ve.waiting[0]
                raise ValueError(f"request {r.request_id} ({r.input_len} prompt tokens) does not fit "
                                 "in one virtual engine's KV share")
        return self.stats

    def _admit(self, ve: _VirtualEngine, budget: int, num_seqs: int) -> list[SimRequest]:
        new: list[SimRequest] = []
        while ve.waiting and num_seqs + len(new) < self.inst.max_num_seqs:
            r = ve.waiting[0]
            chunk = r.input_len if not self.hybrid else min(r.input_len, budget)
            if chunk > budget or chunk <= 0 or not ve.kv.can_admit(r.input_len + 1):
                break
            ve.waiting.popleft()
            ve.kv.used += -(-(r.input_len + 1) // ve.kv.block_size)  # whole prompt reserved
            budget -= chunk
            new.append(r)
        return new

    def _step_separate(self, ve: _VirtualEngine, t: float) -> float | None:
        new = self._admit(ve, self.inst.max_batch_tokens, len(ve.running))
        if new:  # prefill first
            end = self.pipe.submit(sum(r.input_len for r in new), t)
            for r in new:
                r.num_generated, r.num_prefilled = 1, r.input_len
            self.stats.output_tokens += len(new)
            ve.running += new
            self._retire(ve, end)
            return end
        if not ve.running:
            return None
        self._preempt_overflow(ve)
        end = self.pipe.submit(len(ve.running), t)
        self._decode_tokens(ve, ve.running, end)
        return end

    def _step_hybrid(self, ve: _VirtualEngine, t: float) -> float | None:
        self._preempt_overflow(ve)
        decoding = [r for r in ve.running if r.num_prefilled == r.input_len]
        budget = self.inst.max_batch_tokens - len(decoding)
        chunks: list[tuple[SimRequest, int]] = []
        for r in ve.running:  # continue partially prefilled prompts first
            if r.num_prefilled < r.input_len and budget > 0:
                c = min(budget, r.input_len - r.num_prefilled)
                chunks.append((r, c))
                budget -= c
        for r in self._admit(ve, budget, len(ve.running)):
            c = min(budget, r.input_len)
            chunks.append((r, c))
            budget -= c
            ve.running.append(r)
        if not decoding and not chunks:
            return None
        end = self.pipe.submit(len(decoding) + sum(c for _, c in chunks), t)
        self._decode_tokens(ve, decoding, end, retire=False)
        for r, c in chunks:
            r.num_prefilled += c
            if r.num_prefilled == r.input_len:  # last chunk yields the first token
                r.num_generated = 1
                self.stats.output_tokens += 1
        self._retire(ve, end)
        return end

    def _decode_tokens(self, ve: _VirtualEngine, batch: list[SimRequest], end: float, retire: bool = True) -> None:
        for r in batch:
            ve.kv.grow(r)
            r.num_generated += 1
        self.stats.output_tokens += len(batch)
        if retire:
            self._retire(ve, end)

    def _retire(self, ve: _VirtualEngine, end: float) -> None:
        live = []
        for r in ve.running:
            if r.num_generated and r.finished:
                ve.kv.release(r)
                r.finish_ms = end
            else:
                live.append(r)
        ve.running = live

    def _preempt_overflow(self, ve: _VirtualEngine) -> None:
        """Recompute-preempt the newest requests until the next decode step fits."""
        def need() -> int:
            return sum(-(-(r.kv_len + 1) // ve.kv.block_size) - ve.kv.blocks(r)
                       for r in ve.running if r.num_generated)
        while ve.running and ve.kv.used + need() > ve.kv.capacity_blocks:
            victim = ve.running.pop()
            ve.kv.used -= -(-(victim.input_len + 1) // ve.kv.block_size) if not victim.num_generated \
                else ve.kv.blocks(victim)
            victim.preempt()
            ve.waiting.appendleft(victim)
            self.stats.num_preemptions += 1
