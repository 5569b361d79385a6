"""What a plan is held to (`SLO`) and how the simulated cluster behaves (`SimConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.node_runtime.node_config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS
from pdserve.router.prefill_offload import DEFAULT_SATURATED_TOKENS


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request, and the share of requests that must meet both."""

    ttft_s: float
    """Time to first token, in seconds (the prefill's token, after the KV transfer)."""
    tpot_s: float
    """Time per output token after the first, in seconds (a request's mean over its decode)."""
    attainment: float = 0.9
    """Fraction of requests that must meet both targets for a rate to count as goodput."""

    def __post_init__(self) -> None:
        """ValueError naming the flag (`pdserve plan`'s and benchmarks/goodput.py's are the same)."""
        for flag, value in (("--ttft-slo", self.ttft_s), ("--tpot-slo", self.tpot_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment:g}")

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster's scheduling limits and costs besides the forward passes."""

    max_batch_tokens: int = 2048
    """Token budget of one prefill batch (whole prompts, FCFS; a longer prompt runs alone) and of one
    colocated step (decode tokens first, then prompt chunks, as vLLM's chunked prefill)."""
    kv_tokens: int = 32768
    """KV tokens one decode (or colocated) instance holds. A request reserves its prompt plus its
    whole output when it is admitted, so the simulation never preempts."""
    transfer_ms_per_token: float = 0.0
    """KV transfer from a prefill to a decode instance, in ms per prompt token; it is part of TTFT
    and overlaps the prefill instance's next batch."""
    parallel_fraction: float = 0.9
    """For a degree (TP or threads) the profile has no table for: the share of a forward that
    speeds up with the degree (Amdahl), scaled from the nearest measured degree below (modelled)."""
    prefill_saturated_tokens: int = DEFAULT_SATURATED_TOKENS
    """Disaggregated shapes, as the router does (its flag of the same name): while the least loaded
    prefill instance has at least this many prompt tokens queued or running, a decode instance
    prefills a prompt itself if its own local prompts plus this one come to no more than that
    queue; 0: never."""
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    """Disaggregated shapes, as a decode node does (its flag of the same name): a prompt this short
    or shorter is prefilled on the decode instance, not sent to a prefill instance; 0: never."""
    host_cpu_ms_per_request: float = 0.0
    """Core budgets: CPU ms per request that other processes on the same cores take (the router's
    HTTP, tokenizer and streaming, a load generator on the machine); benchmarks/goodput.py measures
    it (`host_cpu_ms_per_request`). At rate R they take R x this of the cores' time: first the
    cores the shape leaves free, then a share of the shape's, which slows every forward
    (`host_slowdown`); 0: the forwards have their cores to themselves."""

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.kv_tokens < 1:
            raise ValueError(
                f"max_batch_tokens and kv_tokens must be >= 1, got {self.max_batch_tokens}, {self.kv_tokens}"
            )
        if self.transfer_ms_per_token < 0:
            raise ValueError(f"transfer_ms_per_token must be >= 0, got {self.transfer_ms_per_token}")
        if not 0.0 <= self.parallel_fraction <= 1.0:
            raise ValueError(f"parallel_fraction must be in [0, 1], got {self.parallel_fraction}")
        for name in ("prefill_saturated_tokens", "local_prefill_max_tokens", "host_cpu_ms_per_request"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def host_slowdown(self, rate: float, units: int, cores: int) -> float | None:
        """How many times longer a forward of a shape on `units` of `cores` cores takes at `rate`
        req/s, the other processes taking `host_cpu_ms_per_request` each: their load beyond the free
        cores shares the shape's (processor sharing). None when it alone needs all of them."""
        excess = rate * self.host_cpu_ms_per_request / 1000.0 - max(0, cores - units)
        if excess <= 0:
            return 1.0
        return units / (units - excess) if excess < units else None
