"""Discrete-event model of an N-stage pipeline and the KV memory of one instance."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.block_manager import blocks_for
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.workload import SimRequest


@dataclass
class SimStats:
    """What one simulated run produced."""

    name: str
    makespan_ms: float = 0.0
    output_tokens: int = 0
    busy_ms: float = 0.0
    """Sum over stages of time spent computing."""
    num_stages: int = 1
    phase_switches: list[tuple[float, str]] = field(default_factory=list)
    kv_samples: list[tuple[float, float]] = field(default_factory=list)
    """(time ms, fraction of KV blocks in use)."""
    num_preemptions: int = 0

    @property
    def throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / (self.makespan_ms / 1000.0) if self.makespan_ms else 0.0

    @property
    def bubble_ms(self) -> float:
        """Stage-idle time summed over stages."""
        return self.num_stages * self.makespan_ms - self.busy_ms

    def summary(self) -> dict:
        return {
            "policy": self.name,
            "throughput_tok_s": round(self.throughput, 1),
            "makespan_s": round(self.makespan_ms / 1000, 2),
            "bubble_frac": round(self.bubble_ms / max(1e-9, self.num_stages * self.makespan_ms), 4),
            "phase_switches": len(self.phase_switches),
            "preemptions": self.num_preemptions,
            "mean_kv_usage": round(sum(u for _, u in self.kv_samples) / max(1, len(self.kv_samples)), 4),
        }


class Pipeline:
    """Equal stages in a flow shop: a batch enters stage k when it left stage k−1
    and stage k is free. Batches therefore leave in the order they entered."""

    def __init__(self, table: CostTable, num_stages: int, stats: SimStats) -> None:
        if num_stages <= 0:
            raise ValueError(f"num_stages must be > 0, got {num_stages}")
        self.table = table
        self.num_stages = num_stages
        self.stage_free = [0.0] * num_stages
        self.stats = stats
        stats.num_stages = num_stages

    def submit(self, num_tokens: int, ready_ms: float, decode: bool = False, kv_tokens: int | None = None) -> float:
        """Run a batch of `num_tokens` tokens that may start at `ready_ms`; returns its exit time.

        With the table's fitted overheads (`tdpipe.overheads`), the batch reaches the first stage
        a dispatch after `ready_ms`, each later stage a hand-off after the previous one let it go,
        a stage faster than the slowest takes its share of the slowest stage's time, and a decode
        step whose sequences read `kv_tokens` KV tokens in all costs each stage its KV slope times
        their distance from the table's KV length."""
        over = self.table.overheads
        t = self.table.stage_ms(num_tokens, self.num_stages)
        times = [t * share for share in over.shares(self.num_stages, decode)]
        if decode and kv_tokens is not None:
            extra = over.decode_kv_extra(self.num_stages, num_tokens, kv_tokens)
            times = [max(0.0, a + b) for a, b in zip(times, extra)]
        end = ready_ms + over.dispatch(num_tokens)
        for k in range(self.num_stages):
            if k:
                end += over.handoff(num_tokens)
            end = max(end, self.stage_free[k]) + times[k]
            self.stage_free[k] = end
        self.stats.busy_ms += sum(times)
        self.stats.makespan_ms = max(self.stats.makespan_ms, end)
        return end


class KVPool:
    """Block accounting for one instance (or one virtual engine of it)."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.used = 0

    def blocks(self, req: SimRequest) -> int:
        return blocks_for(req.kv_len, self.block_size)

    def can_admit(self, num_tokens: int) -> bool:
        return self.used + blocks_for(num_tokens, self.block_size) <= self.capacity_blocks

    def reserve(self, num_tokens: int) -> None:
        """Account a newly admitted request that will hold `num_tokens` tokens after its prefill
        (its prompt plus the slot of the first generated token, which the first decode writes)."""
        self.used += blocks_for(num_tokens, self.block_size)

    def release(self, req: SimRequest) -> None:
        self.used -= self.blocks(req)

    def grow(self, req: SimRequest) -> None:
        """Account the token `req` just generated (call after its `num_generated` grew): the next
        forward writes its KV, so the pool holds `kv_len` positions for it from now on."""
        self.used += self.blocks(req) - blocks_for(req.kv_len - 1, self.block_size)

    @property
    def usage(self) -> float:
        return self.used / self.capacity_blocks
