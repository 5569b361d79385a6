"""TD-Pipe controller on the simulated pipeline: alternate whole prefill and decode phases."""

from __future__ import annotations

from collections import deque

from tdpipe.config import InstanceConfig, TDPipeOptions
from tdpipe.cost_table import CostTable
from tdpipe.intensity import decide
from tdpipe.memory_sim import FutureMemory, FuturePointsConfig
from tdpipe.pipeline import KVPool, Pipeline, SimStats, blocks_for
from tdpipe.work_stealing import WorkStealer
from tdpipe.workload import SimRequest


class TDPipeScheduler:
    """Temporally disaggregated pipeline: prefill phases and decode phases in turn."""

    def __init__(self, table: CostTable, inst: InstanceConfig, opts: TDPipeOptions, name: str = "td-pipe") -> None:
        self.table, self.inst, self.opts = table, inst, opts
        self.stats = SimStats(name)
        self.pipe = Pipeline(table, inst.num_stages, self.stats)
        self.kv = KVPool(inst.capacity_blocks, inst.block_size)
        self.future = FuturePointsConfig(inst.capacity_blocks, inst.block_size,
                                         opts.future_interval, opts.future_horizon)
        self.ready_ms: dict[int, float] = {}

    def run(self, requests: list[SimRequest]) -> SimStats:
        waiting: deque[SimRequest] = deque(requests)
        resident: list[SimRequest] = []
        now = 0.0
        while waiting or resident:
            if waiting:
                resident += self._prefill_phase(waiting, resident, now)
            if not resident:
                if waiting:
                    raise ValueError(f"request {waiting[0].request_id} ({waiting[0].input_len} prompt tokens) "
                                     "does not fit in the KV capacity")
                break
            resident, now = self._decode_phase(resident, waiting)
        return self.stats

    def _sample(self, t: float) -> None:
        self.stats.kv_samples.append((t, self.kv.usage))

    def _prefill_phase(self, waiting: deque[SimRequest], resident: list[SimRequest], now: float) -> list[SimRequest]:
        self.stats.phase_switches.append((now, "prefill"))
        memory = FutureMemory(self.future)
        for r in resident:
            memory.add(r.input_len, r.num_generated, r.predicted_len)
        admitted: list[SimRequest] = []
        batch: list[SimRequest] = []
        while waiting:
            r = waiting[0]
            if not self.kv.can_admit(r.input_len + 1):
                break
            nothing_resident = not resident and not admitted
            if self.opts.prefill_switch == "greedy":
                full = memory.would_overflow(r.input_len, 1, r.predicted_len)
            else:
                full = self.kv.usage >= self.opts.kv_threshold
            if full and not nothing_resident:
                break
            waiting.popleft()
            if batch and sum(b.input_len for b in batch) + r.input_len > self.inst.max_batch_tokens:
                self._run_prefill(batch, now)
                batch = []
            r.num_generated = 1  # prefill produces the first token
            self.kv.admit(r)
            memory.add(r.input_len, 1, r.predicted_len)
            batch.append(r)
            admitted.append(r)
        if batch:
            self._run_prefill(batch, now)
        live = [r for r in admitted if not r.finished]
        for r in admitted:
            if r.finished:
                self.kv.release(r)
        return live

    def _run_prefill(self, batch: list[SimRequest], now: float) -> None:
        end = self.pipe.submit(sum(r.input_len for r in batch), now)
        for r in batch:
            self.ready_ms[r.request_id] = end
            r.finish_ms = end if r.finished else -1.0
        self.stats.output_tokens += len(batch)
        self._sample(end)

    def _decode_phase(self, resident: list[SimRequest], waiting: deque[SimRequest]) -> tuple[list[SimRequest], float]:
        stealer: WorkStealer[SimRequest] = WorkStealer(self.inst.num_stages, self.opts.work_stealing)
        inflight: deque[tuple[list[SimRequest], float]] = deque()
        batches = [b for b in stealer.start(resident) if b]
        # The phase starts when the first decode batch may enter: its requests' prefills are done.
        start = min(max(self.ready_ms[r.request_id] for r in b) for b in batches)
        self.stats.phase_switches.append((start, "decode"))
        for b in batches:
            inflight.append((b, self._submit_decode(b, start)))
        num_phase, num_done, num_returns = len(resident), 0, 0
        # Predicted KV at futurePoints counted from this phase's start; requests that
        # finish early leave it, so the pending prefills below are what greedy
        # prefill would admit if the controller switched now.
        memory = FutureMemory(self.future)
        joined = {r.request_id: (r.input_len, r.num_generated, r.predicted_len) for r in resident}
        for args in joined.values():
            memory.add(*args)
        parked: list[SimRequest] = []
        switch_ms = -1.0
        while inflight:
            batch, end = inflight.popleft()
            num_returns += 1
            step = num_returns // self.inst.num_stages
            remaining = []
            for r in batch:
                self.kv.grow(r)
                r.num_generated += 1
                self.ready_ms[r.request_id] = end
                if r.finished:
                    self.kv.release(r)
                    r.finish_ms = end
                    num_done += 1
                    memory.remove(*joined[r.request_id], from_step=step)
                else:
                    remaining.append(r)
            self.stats.output_tokens += len(batch)
            for victim in self._preempt_overflow(remaining, stealer, waiting):
                memory.remove(*joined[victim.request_id], from_step=step)
            self._sample(end)
            if switch_ms >= 0:
                parked += remaining
                continue
            if waiting and self._should_prefill(stealer, remaining, waiting, num_done / num_phase,
                                                memory, step):
                switch_ms = end
                parked += remaining + stealer.drain_held()
                continue
            nxt = stealer.rebalance(remaining)
            if nxt:
                inflight.append((nxt, self._submit_decode(nxt, end)))
        parked += stealer.drain_held()
        return parked, (switch_ms if switch_ms >= 0 else self.stats.makespan_ms)

    def _submit_decode(self, batch: list[SimRequest], ready: float) -> float:
        ready = max([ready] + [self.ready_ms[r.request_id] for r in batch])
        return self.pipe.submit(len(batch), ready)

    def _preempt_overflow(self, remaining: list[SimRequest], stealer: WorkStealer[SimRequest],
                          waiting: deque[SimRequest]) -> list[SimRequest]:
        """Out of KV (a prediction was too short): recompute-preempt the newest requests."""
        victims = []
        while self.kv.used > self.kv.capacity_blocks and (remaining or stealer.held):
            victim = remaining.pop() if remaining else stealer.held.pop()
            victims.append(victim)
            self.kv.release(victim)
            victim.preempt()
            waiting.appendleft(victim)
            self.stats.num_preemptions += 1
        return victims

    def _should_prefill(self, stealer: WorkStealer[SimRequest], remaining: list[SimRequest],
                        waiting: deque[SimRequest], done_ratio: float,
                        memory: FutureMemory, step: int) -> bool:
        if self.opts.decode_switch == "completion":
            return done_ratio >= self.opts.completion_threshold
        batch_size = stealer.average(len(remaining)) if self.opts.work_stealing else len(remaining)
        pending, tokens, free = [], 0, self.kv.capacity_blocks - self.kv.used
        added: list[tuple[int, int, int]] = []
        for r in waiting:  # the prefills greedy prefill would run if we switched now
            need = blocks_for(r.input_len + 1, self.inst.block_size)
            args = (r.input_len, 1, r.predicted_len)
            if self.opts.prefill_switch == "greedy":
                full = memory.would_overflow(*args, offset=step)
            else:
                full = (self.kv.capacity_blocks - free) / self.kv.capacity_blocks >= self.opts.kv_threshold
            if need > free or full:
                break
            memory.add(*args, offset=step)
            added.append(args)
            free -= need
            if tokens + r.input_len > self.inst.max_batch_tokens and tokens:
                pending.append(self.table.stage_ms(tokens, self.inst.num_stages))
                tokens = 0
            tokens += r.input_len
        if tokens:
            pending.append(self.table.stage_ms(tokens, self.inst.num_stages))
        for args in added:
            memory.remove(*args, offset=step)
        step_ms = self.table.stage_ms(batch_size, self.inst.num_stages)
        # With `phase`, peak is the batch this phase started with: the KV capacity, not the
        # device, caps the decode batch (about 115 per batch for Llama-13B on 4x L20), and
        # against 256 the spatial intensity is ~0.6 from the first step, so any modest
        # pending prefill won (a switch every ~10% of a phase, see docs/tdpipe.md).
        phase = done_ratio if self.opts.spatial_peak == "phase" else None
        return decide(self.table, batch_size, pending, step_ms, self.inst.num_stages,
                      self.opts.ref_batch_size, self.opts.temporal_refill, phase).switch_to_prefill
