"""TD-Pipe controller: alternate whole prefill and decode phases (on the simulator or on real stages)."""

from __future__ import annotations

from collections import deque
from typing import Sequence

from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import BatchItem, Executor, Phase, SimExecutor
from pdserve.tdpipe.intensity import decide
from pdserve.tdpipe.memory_sim import FutureMemory, FuturePointsConfig
from pdserve.tdpipe.pipeline import KVPool, SimStats, blocks_for
from pdserve.tdpipe.work_stealing import WorkStealer
from pdserve.tdpipe.workload import SimRequest


class TDPipeScheduler:
    """Temporally disaggregated pipeline: prefill phases and decode phases in turn.

    The same object decides for the simulator (`SimExecutor`, the default) and for
    the real stage processes (`tdpipe.runtime.controller.StageExecutor`).
    """

    def __init__(self, table: CostTable, inst: InstanceConfig, opts: TDPipeOptions, name: str = "td-pipe") -> None:
        self.table, self.inst, self.opts = table, inst, opts
        self.stats = SimStats(name)
        self.kv = KVPool(inst.capacity_blocks, inst.block_size)
        self.future = FuturePointsConfig(
            inst.capacity_blocks, inst.block_size, opts.future_interval, opts.future_horizon
        )
        self.ready_ms: dict[int | str, float] = {}
        self.ex: Executor = SimExecutor(table, inst.num_stages)
        self._num_admitted = 0
        """Requests the last prefill phase admitted (all may finish at their prefill)."""

    def run(self, requests: Sequence[SimRequest], executor: Executor | None = None) -> SimStats:
        """Run `requests` to completion on `executor` (default: the simulator)."""
        self.ex = executor or SimExecutor(self.table, self.inst.num_stages)
        self.ex.attach(self.stats)
        # a deque (tdpipe.feed.RequestFeed) is used as is: it fills itself as the phases drain it
        waiting: deque[SimRequest] = requests if isinstance(requests, deque) else deque(requests)
        resident: list[SimRequest] = []
        now = 0.0
        while waiting or resident:
            admitted = 0
            if waiting:
                resident += self._prefill_phase(waiting, resident, now)
                admitted = self._num_admitted
            if not resident:
                if waiting and not admitted:
                    raise ValueError(
                        f"request {waiting[0].request_id} ({waiting[0].input_len} prompt tokens) "
                        "does not fit in the KV capacity"
                    )
                continue  # every admitted request finished at its prefill (max_tokens 1): admit more
            resident, now = self._decode_phase(resident, waiting)
        return self.stats

    def _sample(self, t: float) -> None:
        self.stats.kv_samples.append((t, self.kv.usage))

    def _release(self, r: SimRequest, end: float) -> None:
        self.kv.release(r)
        self.ready_ms.pop(r.request_id, None)  # a streamed job retires millions of ids: keep only the live ones
        r.finish_ms = end
        self.ex.finish(r)

    def _prefill_phase(self, waiting: deque[SimRequest], resident: list[SimRequest], now: float) -> list[SimRequest]:
        self.stats.phase_switches.append((now, Phase.PREFILL))
        admitted, _ = self._submit_prefills(waiting, resident, now)
        # The phase ends when every prefill is back: the first decode step needs each prompt's token.
        while self.ex.inflight:
            done = self.ex.collect()
            for item in done.items:
                self.ready_ms[item.request.request_id] = done.end_ms
            self._sample(done.end_ms)
        live = []
        for r in admitted:
            if r.finished:
                self._release(r, self.ready_ms[r.request_id])
            else:
                live.append(r)
        return live

    def _submit_prefills(
        self, waiting: deque[SimRequest], resident: list[SimRequest], now: float
    ) -> tuple[list[SimRequest], int]:
        """Greedy prefill: admit waiting requests while the predicted KV fits, submit them in
        `max_batch_tokens` batches; returns (the admitted requests, the batches submitted)."""
        memory = FutureMemory(self.future)
        for r in resident:
            memory.add(r.input_len, r.num_generated, r.predicted_len)
        admitted: list[SimRequest] = []
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
            self.kv.reserve(r.input_len + 1)  # the prompt, and the slot of the token its prefill yields
            memory.add(r.input_len, 1, r.predicted_len)
            admitted.append(r)
        left = [r.input_len for r in admitted]  # prompt tokens not yet in a batch
        batches = self._prefill_batches(left)  # packed before the loop below consumes `left`
        for k, batch in enumerate(batches):
            items = []
            for i, n in batch:
                left[i] -= n
                items.append(BatchItem(admitted[i], n, left[i] == 0))  # the last chunk yields the first token
            self.ex.submit(items, Phase.PREFILL, now, hold=self.opts.hold_first_tokens and k < len(batches) - 1)
        self._num_admitted = len(admitted)
        return admitted, len(batches)

    def _prefill_batches(self, prompt_lens: list[int], chunk: bool | None = None) -> list[PrefillBatch]:
        """A phase's prompts (in order) packed into its prefill batches (`chunk`: split prompts;
        default `chunk_prefills`)."""
        chunk = self.opts.chunk_prefills if chunk is None else chunk
        if not self.opts.size_prefill_batches:
            return pack_prompts(prompt_lens, self.inst.max_batch_tokens, chunk)
        return sized_prefill_batches(prompt_lens, self.inst.max_batch_tokens, self.table, self.inst.num_stages, chunk)

    def _decode_phase(self, resident: list[SimRequest], waiting: deque[SimRequest]) -> tuple[list[SimRequest], float]:
        stealer: WorkStealer[SimRequest] = WorkStealer(self.inst.num_stages, self.opts.work_stealing)
        batches = [b for b in stealer.start(resident) if b]
        # The phase starts when the first decode batch may enter: its requests' prefills are done.
        start = min(max(self.ready_ms[r.request_id] for r in b) for b in batches)
        self.stats.phase_switches.append((start, Phase.DECODE))
        for b in batches:
            self._submit_decode(b, start)
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
        while self.ex.inflight:
            done = self.ex.collect()
            end = done.end_ms
            num_returns += 1
            step = num_returns // self.inst.num_stages
            remaining = []
            for item in done.items:
                r = item.request
                self.kv.grow(r)
                self.ready_ms[r.request_id] = end
                if r.finished:
                    self._release(r, end)
                    num_done += 1
                    memory.remove(*joined[r.request_id], from_step=step)
                else:
                    remaining.append(r)
            for victim in self._preempt_overflow(remaining, stealer, waiting):
                memory.remove(*joined[victim.request_id], from_step=step)
            self._sample(end)
            if switch_ms >= 0:
                parked += remaining
                continue
            if waiting and self._should_prefill(stealer, remaining, waiting, num_done / num_phase, memory, step):
                switch_ms = end
                parked += remaining + stealer.drain_held()
                continue
            nxt = stealer.rebalance(remaining)
            if nxt:
                self._submit_decode(nxt, end)
        parked += stealer.drain_held()
        return parked, (switch_ms if switch_ms >= 0 else self.stats.makespan_ms)

    def _submit_decode(self, batch: list[SimRequest], ready: float) -> None:
        ready = max([ready] + [self.ready_ms[r.request_id] for r in batch])
        self.ex.submit([BatchItem(r, 1, True) for r in batch], Phase.DECODE, ready)

    def _preempt_overflow(
        self, remaining: list[SimRequest], stealer: WorkStealer[SimRequest], waiting: deque[SimRequest]
    ) -> list[SimRequest]:
        """Out of KV (a prediction was too short): recompute-preempt the newest requests."""
        victims = []
        while self.kv.used > self.kv.capacity_blocks and (remaining or stealer.held):
            victim = remaining.pop() if remaining else stealer.held.pop()
            victims.append(victim)
            self.kv.release(victim)
            self.ex.free(victim)
            victim.preempt()
            waiting.appendleft(victim)
            self.stats.num_preemptions += 1
        return victims

    def _should_prefill(
        self,
        stealer: WorkStealer[SimRequest],
        remaining: list[SimRequest],
        waiting: deque[SimRequest],
        done_ratio: float,
        memory: FutureMemory,
        step: int,
    ) -> bool:
        if self.opts.decode_switch == "completion":
            return done_ratio >= self.opts.completion_threshold
        batch_size = stealer.average(len(remaining)) if self.opts.work_stealing else len(remaining)
        lens, free = [], self.kv.capacity_blocks - self.kv.used
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
            lens.append(r.input_len)
        # The batches the switch would submit, priced as whole prompts even where the phase will
        # split them: its cheaper fill and drain made the rule switch about twice as often (6 phases
        # against 4 on benchmarks/tdpipe_runtime.py's job, 222 against 122 on the L20 table's 5,000
        # requests) for no steady gain (CPU profile 1-2% slower, L20 within 1.5% either way) and
        # cost recompute preemptions on the runtime.
        whole = self._prefill_batches(lens, chunk=False)
        pending = [self.table.stage_ms(n, self.inst.num_stages) for n in batch_tokens(whole)]
        for args in added:
            memory.remove(*args, offset=step)
        step_ms = self.table.stage_ms(batch_size, self.inst.num_stages)
        # With `phase`, peak is the batch this phase started with: the KV capacity, not the
        # device, caps the decode batch (about 115 per batch for Llama-13B on 4x L20), and
        # against 256 the spatial intensity is ~0.6 from the first step, so any modest
        # pending prefill won (median switch after 7% of a phase, see docs/tdpipe.md).
        phase = done_ratio if self.opts.spatial_peak == "phase" else None
        return decide(
            self.table,
            batch_size,
            pending,
            step_ms,
            self.inst.num_stages,
            self.opts.ref_batch_size,
            self.opts.temporal_refill,
            phase,
        ).switch_to_prefill


PrefillBatch = list[tuple[int, int]]
"""One prefill batch: (index of a prompt among the phase's prompts, its tokens in this batch), in order."""

MIN_CHUNK = 16
"""Fewest tokens in a piece of a split prompt. Besides sparing a batch a sliver, it keeps every batch
that continues a prompt off the decode split: a batch of 1-token items counts as a decode step
(`ForwardBatch.is_decode_only`), and under the phase split a continuation must run on the prefill
split, as its earlier chunks did, or a stage could read a layer's KV that its neighbour is still
writing (`tdpipe.runtime.stage_split`)."""


def pack_prompts(prompt_lens: list[int], cap: int, chunk: bool = False) -> list[PrefillBatch]:
    """The prompts, in order, packed into batches of up to `cap` tokens.

    Whole prompts (`chunk` False): a prompt that does not fit in the current batch starts the
    next one, and a prompt longer than `cap` is a batch alone. Chunked: a prompt that does not fit
    fills the current batch and continues in the next (its chunks run in order; the last one
    yields its first token), so every batch but the last is full to within 2 `MIN_CHUNK`s.
    No piece of a split prompt is shorter than `MIN_CHUNK`; a cap under two of them keeps prompts
    whole.
    """
    chunk = chunk and cap >= 2 * MIN_CHUNK
    batches: list[PrefillBatch] = []
    room = 0
    for i, n in enumerate(prompt_lens):
        while n > 0:
            if batches and n <= room:  # the rest of the prompt fits
                batches[-1].append((i, n))
                room -= n
                break
            take = min(room, n - MIN_CHUNK) if chunk else 0  # split here, leaving a tail of MIN_CHUNK or more
            if take < MIN_CHUNK:  # no room worth a piece: a new batch, whole if the prompt fits or stays whole
                batches.append([])
                room = cap
                take = min(cap, n - MIN_CHUNK) if chunk and n > cap else n
            batches[-1].append((i, take))
            room -= take
            n -= take
    return batches


def batch_tokens(batches: list[PrefillBatch]) -> list[int]:
    """The tokens of each batch."""
    return [sum(n for _, n in b) for b in batches]


def sized_prefill_batches(
    prompt_lens: list[int], budget: int, table: CostTable, num_stages: int, chunk: bool = False
) -> list[PrefillBatch]:
    """One prefill phase's batches, their cap chosen to finish the phase soonest.

    In a pipeline of S equal stages a phase of batches taking t_i per stage ends sum(t_i) +
    (S - 1) * max(t_i) after it starts: the largest batch fills or drains the pipeline at every
    phase switch (the decode phase after it needs every prompt's first token). Big batches amortise
    a fixed cost per forward (a GPU's weight reads) and small ones shorten that edge, so the cap is
    taken among eighths of `budget` by the table's prediction of the phase; ties keep the larger
    cap. On bench's CPU profile, where a prefill's time per token is flat from a few hundred tokens,
    that is 512-1536 of 2048 with whole prompts, whose longest one bounds the largest batch; with
    `chunk` (prompts split across batches, `pack_prompts`) the cap bounds it. On the analytic GPU
    table (33 ms a forward), an 8000-token phase of 250-token prompts goes in 1000-token batches.
    """
    best: tuple[float, list[PrefillBatch]] | None = None
    for eighths in range(8, 0, -1):
        batches = pack_prompts(prompt_lens, max(1, budget * eighths // 8), chunk)
        times = [table.stage_ms(n, num_stages) for n in batch_tokens(batches)]
        phase_ms = sum(times) + (num_stages - 1) * max(times, default=0.0)
        if best is None or phase_ms < best[0] * (1 - 1e-9):
            best = (phase_ms, batches)
    return best[1] if best else []
