"""TD-Pipe whose phase switches do not drain the pipeline.

Experimental (the `td-pipe-overlap` policy; `td-pipe` stays `TDPipeScheduler`, see the last
section of docs/tdpipe.md for why). `TDPipeScheduler` ends a decode phase by letting every decode
batch in flight come back, and starts the next one only when the last prefill has left the last
stage: at each switch the first stage idles while the last decode batch crosses the later stages,
and again while the last prefill does. On the real 2-stage runtime that drain and refill were
most of TD-Pipe's measured bubble beyond the per-step round trip.

Here a switch inserts the prefill phase into the flow instead. When a returning decode batch
decides to switch, the prefill batches are submitted at once, behind the decode batches still in
flight, and the returning batch is resubmitted behind the prefills; the other decode batches
are resubmitted as they come back, as in any decode step. The stages still run whole phases
(every stage sees decodes, then the prefills, then decodes: TD-Pipe's temporal disaggregation),
but no stage waits for the pipeline to empty. Newly prefilled requests join the decode batches
through the work stealer's held-back pool. KV admission at the switch counts the block each
request still in flight may add when its step returns.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Executor, Phase, SimExecutor
from pdserve.tdpipe.memory_sim import FutureMemory
from pdserve.tdpipe.pipeline import SimStats, blocks_for
from pdserve.tdpipe.td_scheduler import TDPipeScheduler
from pdserve.tdpipe.work_stealing import WorkStealer
from pdserve.tdpipe.workload import SimRequest


class _Phase:
    """Bookkeeping of one decode phase (from a switch to the next): the switch rule reads it."""

    def __init__(self, scheduler: TDPipeScheduler, residents: list[SimRequest]) -> None:
        self.memory = FutureMemory(scheduler.future)
        self.joined = {r.request_id: (r.input_len, r.num_generated, r.predicted_len) for r in residents}
        for args in self.joined.values():
            self.memory.add(*args)
        self.num_done = self.num_returns = 0


class OverlapTDPipe(TDPipeScheduler):
    """TD-Pipe with non-draining phase switches (module docstring); the `td-pipe-overlap` policy."""

    def run(self, requests: Sequence[SimRequest], executor: Executor | None = None) -> SimStats:
        self.ex = executor or SimExecutor(self.table, self.inst.num_stages)
        self.ex.attach(self.stats)
        waiting: deque[SimRequest] = requests if isinstance(requests, deque) else deque(requests)
        stealer: WorkStealer[SimRequest] = WorkStealer(self.inst.num_stages, self.opts.work_stealing)
        phase = _Phase(self, [])
        prefills = 0  # prefill batches in flight
        now = 0.0
        while waiting or self.ex.inflight or stealer.held:
            if not self.ex.inflight:  # nothing to overlap with: prefill, or start decoding what is held
                if stealer.held:
                    self.stats.phase_switches.append((now, Phase.DECODE))
                    held = stealer.drain_held()
                    phase = _Phase(self, held)
                    # more batches than stages where that hides the per-batch round trip (overheads)
                    stealer.resize(decode_batches_in_flight(self.table, self.inst.num_stages, len(held)))
                    for b in stealer.start(held):
                        if b:
                            self._submit_decode(b, now)
                    continue
                prefills = self._switch(waiting, stealer, [], now)
                if not prefills:
                    r = waiting[0]
                    raise ValueError(
                        f"request {r.request_id} ({r.input_len} prompt tokens) does not fit in the KV capacity"
                    )
                continue
            done = self.ex.collect()
            now = done.end_ms
            if done.phase == Phase.PREFILL:
                prefills -= 1
                for item in done.items:
                    if not item.sample:
                        continue  # a prompt's earlier chunk: its last chunk brings the request in
                    r = item.request
                    self.ready_ms[r.request_id] = now
                    if r.finished:  # max_tokens 1: done at its prefill
                        self._release(r, now)
                    else:
                        stealer.held.append(r)
                self._sample(now)
                if not prefills:
                    self._fill_slots(stealer, now)
                continue
            phase.num_returns += 1
            step = phase.num_returns // stealer.num_stages  # a step: every batch advanced once
            remaining = []
            for item in done.items:
                r = item.request
                self.kv.grow(r)
                self.ready_ms[r.request_id] = now
                if r.finished:
                    self._release(r, now)
                    if r.request_id in phase.joined:
                        phase.num_done += 1
                        phase.memory.remove(*phase.joined[r.request_id], from_step=step)
                else:
                    remaining.append(r)
            for victim in self._preempt_overflow(remaining, stealer, waiting):
                if victim.request_id in phase.joined:
                    phase.memory.remove(*phase.joined[victim.request_id], from_step=step)
            self._sample(now)
            done_ratio = phase.num_done / max(1, len(phase.joined))
            # no new switch while the last one's prefills are in the pipeline (their requests
            # are not yet in the decode batches the rule reads)
            switch = bool(waiting) and not prefills
            if switch and not self._should_prefill(stealer, remaining, waiting, done_ratio, phase.memory, step):
                switch = False
            nxt = stealer.rebalance(remaining)
            if switch:
                prefills = self._switch(waiting, stealer, nxt, now)
                residents = nxt + stealer.held + self._in_flight(decode=True)
                phase = _Phase(self, residents + self._in_flight(decode=False))
            if nxt:
                self._submit_decode(nxt, now)
        return self.stats

    def _in_flight(self, decode: bool) -> list[SimRequest]:
        """The requests of the decode (or prefill) batches in flight."""
        return [i.request for b in self.ex.inflight if (b.phase == Phase.PREFILL) != decode for i in b.items]

    def _switch(
        self, waiting: deque[SimRequest], stealer: WorkStealer[SimRequest], nxt: list[SimRequest], now: float
    ) -> int:
        """Submit a prefill phase now; returns how many prefill batches it submitted."""
        self.stats.phase_switches.append((now, Phase.PREFILL))
        in_flight = self._in_flight(decode=True)
        # each in-flight step writes one more token when it returns: that block must stay free
        growth = sum(blocks_for(r.kv_len + 1, self.kv.block_size) - self.kv.blocks(r) for r in in_flight)
        self.kv.used += growth
        try:
            _, batches = self._submit_prefills(waiting, nxt + stealer.held + in_flight, now)
        finally:
            self.kv.used -= growth
        if not batches:  # the KV had no room after all (the rule's estimate ignores in-flight growth)
            self.stats.phase_switches.pop()
        elif nxt or in_flight:
            self.stats.phase_switches.append((now, Phase.DECODE))  # decoding resumes behind the prefills
        return batches

    def _fill_slots(self, stealer: WorkStealer[SimRequest], now: float) -> None:
        """Once the prefills are back: if batches emptied out while they ran, give the pipeline
        its `num_stages` decode batches again from the held-back requests."""
        in_flight = sum(1 for b in self.ex.inflight if b.phase != Phase.PREFILL)
        missing = stealer.num_stages - in_flight
        if missing <= 0 or not in_flight or not stealer.held:
            return  # nothing in flight at all: the main loop starts a fresh phase
        held = stealer.drain_held()
        for b in (held[i::missing] for i in range(missing)):
            if b:
                stealer.window.append(len(b))
                self._submit_decode(b, now)


def decode_batches_in_flight(table: CostTable, num_stages: int, num_requests: int) -> int:
    """How many decode batches to keep in the pipeline: `num_stages` (the paper's choice, and the
    answer with zero overheads) unless more, smaller batches hide the round trip of each batch.

    A batch cycles through the stages, the hand-offs and the dispatch before its next step can
    start; with k batches of the `num_requests` requests a stage is busy k stage-times per cycle,
    so a round of steps takes max(k * t, num_stages * t + hand-offs + dispatch). Up to twice the
    stage count is tried; more batches are used only for a gain of over 2% (smaller batches
    cost more per token where a step has a fixed part)."""
    over = table.overheads
    best_k, best = num_stages, 0.0
    for k in range(num_stages, 2 * num_stages + 1):
        b = max(1, -(-num_requests // k))
        t = table.stage_ms(b, num_stages)
        cycle = max(k * t, num_stages * t + (num_stages - 1) * over.handoff(b) + over.dispatch(b))
        rate = k * b / cycle
        if rate > best * 1.02:
            best_k, best = k, rate
    return best_k
