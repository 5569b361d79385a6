"""Small factories for the planner tests: a linear cost table, requests, a config."""

from __future__ import annotations

from pdserve.planner.config import SimConfig
from pdserve.planner.workload import Lengths
from pdserve.tdpipe.cost_table import CostTable


def linear_table(fixed_ms: float = 20.0, per_token_ms: float = 0.1, max_tokens: int = 4096) -> CostTable:
    """`fixed + per_token * n` ms at two points (the table interpolates between them)."""
    return CostTable("linear", (1, max_tokens), (fixed_ms + per_token_ms, fixed_ms + per_token_ms * max_tokens))


def requests(n: int, input_len: int = 100, output_len: int = 10) -> list[Lengths]:
    return [Lengths(input_len, output_len)] * n


def config(**kw) -> SimConfig:
    """A SimConfig whose disaggregated shapes prefill only on prefill instances (no local prefill,
    no offload) unless `kw` says otherwise: the tests of batching and queueing price one path."""
    return SimConfig(**{"prefill_saturated_tokens": 0, "local_prefill_max_tokens": 0, **kw})
