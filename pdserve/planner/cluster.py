"""The discrete-event simulation of one cluster shape at one arrival rate.

Disaggregated (`num_prefill >= 1`): a request goes to the prefill instance with the fewest queued
prompt tokens, is prefilled in an FCFS batch, and its KV travels to the decode instance with the
least KV reserved or waiting (`transfer_ms_per_token`, beside the next prefill batch). Its first
token counts once the KV has arrived; a one-token request ends there. As in pdserve, a decode
instance prefills a prompt itself, chunked beside its decode steps, when the prompt is at most
`local_prefill_max_tokens` or the prefill instances are saturated (`prefill_saturated_tokens`: the
router's offload rule, router/prefill_offload.py). Colocated (`num_prefill ==
0`): every instance prefills and decodes, chunked (`instances.DecodeInstance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from pdserve.planner.config import SLO, SimConfig
from pdserve.planner.instances import DecodeInstance, EventLoop, PrefillInstance, SimRequest, least_loaded
from pdserve.planner.workload import Lengths
from pdserve.tdpipe.cost_table import CostTable


@dataclass(frozen=True)
class Shape:
    """How many instances of each role, and each instance's degree (GPUs of TP, or threads)."""

    num_prefill: int
    """Prefill instances; 0: colocated, every decode instance also prefills."""
    prefill_degree: int
    """Degree of each prefill instance (0 when colocated)."""
    num_decode: int
    decode_degree: int

    def __post_init__(self) -> None:
        assert self.num_decode >= 1 and self.decode_degree >= 1, f"a shape needs a decode instance: {self}"
        assert (self.num_prefill == 0) == (self.prefill_degree == 0), f"prefill count and degree disagree: {self}"

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def units(self) -> int:
        """GPUs or cores the shape takes."""
        return self.num_prefill * self.prefill_degree + self.num_decode * self.decode_degree

    def label(self, unit: str) -> str:
        """`2P:1D` style name with degrees, e.g. `2P(tp2):1D(tp1)` on GPUs, `1P(2t):1D(1t)` on cores."""
        fmt = (lambda d: f"tp{d}") if unit == "gpu" else (lambda d: f"{d}t")
        decode = f"{self.num_decode}D({fmt(self.decode_degree)})"
        return (
            f"0P:{decode} colocated" if self.colocated else f"{self.num_prefill}P({fmt(self.prefill_degree)}):{decode}"
        )


class Outcome(NamedTuple):
    """One simulated request's latencies in seconds (TPOT 0 for a one-token output)."""

    ttft: float
    tpot: float


def outcome(req: SimRequest) -> Outcome:
    tpot = (req.finish - req.first_token) / (req.output_len - 1) if req.output_len > 1 else 0.0
    return Outcome(req.first_token - req.arrival, tpot)


def simulate(
    shape: Shape,
    prefill_table: CostTable | None,
    decode_table: CostTable,
    requests: list[Lengths],
    arrivals: list[float],
    config: SimConfig,
    give_up: Callable[[Outcome], bool] = lambda o: False,
) -> list[Outcome]:
    """Run the requests through `shape`; the outcomes in the order they finish. `give_up` sees each
    outcome as its request finishes, and a True stops the run there (the caller knows enough)."""
    assert len(requests) == len(arrivals), "one arrival time per request"
    loop = EventLoop()
    done: list[Outcome] = []
    stopped = False

    def finished(req: SimRequest, now: float) -> None:
        nonlocal stopped
        done.append(outcome(req))
        stopped = stopped or give_up(done[-1])

    decoders = [
        DecodeInstance(loop, decode_table, config.kv_tokens, config.max_batch_tokens, shape.colocated, finished)
        for _ in range(shape.num_decode)
    ]

    def to_decode(req: SimRequest, now: float) -> None:
        least_loaded(decoders).submit(req, now)

    def prefilled(req: SimRequest, now: float) -> None:
        req.first_token = now + config.transfer_ms_per_token * req.input_len / 1000.0
        if req.output_len == 1:
            req.finish = req.first_token
            loop.at(req.finish, lambda t: finished(req, t))
        else:
            loop.at(req.first_token, lambda t: to_decode(req, t))

    prefills: list[PrefillInstance] = []
    if not shape.colocated:
        assert prefill_table is not None, "a disaggregated shape needs the prefill table"
        prefills = [
            PrefillInstance(loop, prefill_table, config.max_batch_tokens, prefilled) for _ in range(shape.num_prefill)
        ]

    def arrive(req: SimRequest) -> Callable[[float], None]:
        if shape.colocated:
            return lambda now: least_loaded(decoders).submit(req, now)
        return lambda now: route_disaggregated(req, now)

    def route_disaggregated(req: SimRequest, now: float) -> None:
        """As the decode node and the router do: a short prompt, or one that would wait longer at the
        prefill instances than at a decode instance, is prefilled on the decode instance."""
        decoder = least_loaded(decoders)
        if req.input_len <= config.local_prefill_max_tokens:
            decoder.submit(req, now, prefill=True)
            return
        prefill = least_loaded(prefills)
        queue = prefill.load
        saturated = config.prefill_saturated_tokens
        if saturated and queue >= saturated and decoder.local_prefill + req.input_len <= queue:
            decoder.submit(req, now, prefill=True)
        else:
            prefill.submit(req, now)

    for t, r in zip(arrivals, requests):
        loop.at(t, arrive(SimRequest(t, r.input_len, r.output_len)))
    loop.run(stop=lambda: stopped)
    assert stopped or len(done) == len(requests), "a request was left unfinished"
    return done


def attainment(
    shape: Shape,
    tables: tuple[CostTable | None, CostTable],
    requests: list[Lengths],
    arrivals: list[float],
    slo: SLO,
    config: SimConfig,
    exact: bool = False,
) -> float:
    """Fraction of the requests that meet both SLOs. Unless `exact`, the run stops as soon as more
    requests missed than the target allows, and reports the misses so far: a value below the target,
    which is all a search needs to know."""
    allowed = len(requests) if exact else math.floor((1.0 - slo.attainment) * len(requests) + 1e-9)
    misses = 0

    def give_up(o: Outcome) -> bool:
        nonlocal misses
        misses += not slo.met(o.ttft, o.tpot)
        return misses > allowed

    simulate(shape, tables[0], tables[1], requests, arrivals, config, give_up)
    return 1.0 - misses / len(requests)
