"""What benchmarks/goodput.py sends and to whom: `pdserve up` shapes from `--shapes`, the workload
presets, and Mooncake-format traces read, checked and scaled to a rate and to the model.

Pure functions (no server, no client): unit-tested in tests/benchmarks/test_goodput.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pdserve.planner.config import SLO as Slo

TRACE_BLOCK = 512
"""Tokens per `hash_ids` entry in the Mooncake traces (../shared/traces/README.md)."""


@dataclass(frozen=True)
class Shape:
    """One `pdserve up` target: prefill and decode node counts, and `--num-threads` (None: `auto`,
    which splits and pins the cores between the nodes, a prefill node weighing twice a decode node);
    `told_slo`: `pdserve up` is given the SLOs measured (`--ttft-slo`, `--tpot-slo`), as a user who
    has them would, and its router keeps decode nodes' streams within the TPOT SLO when it offloads."""

    num_prefill: int
    num_decode: int
    threads: int | None = None
    told_slo: bool = False

    @property
    def name(self) -> str:
        threads = f"@{self.threads}" if self.threads else ""
        return f"{self.num_prefill}p{self.num_decode}d{threads}" + ("+slo" if self.told_slo else "")

    def up_args(self, slo: Slo | None = None) -> list[str]:
        """`pdserve up`'s flags for this shape; `slo` is what a `+slo` shape is told."""
        threads = str(self.threads) if self.threads else "auto"
        told: list[str] = []
        if self.told_slo:
            if slo is None:
                raise ValueError(f"{self.name}: a +slo shape needs the SLOs it is told")
            told = ["--ttft-slo", f"{slo.ttft_s:g}", "--tpot-slo", f"{slo.tpot_s:g}"]
        counts = ["--num-prefill", str(self.num_prefill), "--num-decode", str(self.num_decode)]
        return [*counts, "--num-threads", threads, *told]


SHAPE_RE = re.compile(r"^(\d+)p(\d+)d(?:@(\d+))?(\+slo)?$")


def parse_shapes(text: str) -> list[Shape]:
    """`--shapes 1p1d,0p1d,2p2d@1,1p1d@1+slo`: P prefill + D decode nodes (0p1d: colocated, decode
    nodes prefill every prompt), `@N` for N threads per node (unpinned) instead of `auto`, `+slo` for
    `pdserve up` told the SLOs (`Shape.told_slo`). ValueError names the flag."""
    shapes: list[Shape] = []
    for part in (p.strip() for p in text.split(",")):
        m = SHAPE_RE.match(part)
        if not m:
            raise ValueError(f"--shapes: {part!r} is not PpDd[@THREADS][+slo] (e.g. 1p1d, 0p1d, 2p2d@1, 1p1d@1+slo)")
        p, d, t = int(m[1]), int(m[2]), int(m[3]) if m[3] else None
        if d < 1:
            raise ValueError(f"--shapes: {part!r} has no decode node (every shape needs D >= 1)")
        if t is not None and t < 1:
            raise ValueError(f"--shapes: {part!r} asks for {t} threads (N >= 1)")
        shape = Shape(p, d, t, bool(m[4]))
        if shape in shapes:
            raise ValueError(f"--shapes: {part!r} is given twice")
        shapes.append(shape)
    return shapes


@dataclass(frozen=True)
class Preset:
    """A workload and its SLOs. `disagg`: the issue's workload, where disaggregation should pay (long
    prompts, tight TPOT); `honest`: short prompts and a loose TPOT, where it should not."""

    input_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    start_rate: float
    """The search's first rate, req/s (near where the issue measured vLLM's goodput)."""


PRESETS = {
    "disagg": Preset(input_tokens=800, output_tokens=48, ttft_s=5.0, tpot_s=0.25, start_rate=0.1),
    "honest": Preset(input_tokens=64, output_tokens=48, ttft_s=5.0, tpot_s=1.0, start_rate=0.4),
}


class TraceRequest(NamedTuple):
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake-format trace (one JSON object a line: timestamp in ms, input_length, output_length,
    hash_ids), its first `limit` requests. ValueError naming `--trace` and the line for a malformed
    line or a timestamp earlier than the one before it (the replay needs arrival order)."""
    requests: list[TraceRequest] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                req = TraceRequest(
                    float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"]), list(rec["hash_ids"])
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--trace {path}: line {n} is not a trace record ({type(e).__name__}: {e})") from e
            if req.input_length < 1 or req.output_length < 1 or req.timestamp_ms < 0:
                raise ValueError(f"--trace {path}: line {n} has a negative time or a length < 1")
            if requests and req.timestamp_ms < requests[-1].timestamp_ms:
                raise ValueError(
                    f"--trace {path}: timestamps out of order at line {n} "
                    f"({req.timestamp_ms:g} ms after {requests[-1].timestamp_ms:g} ms); sort it by timestamp"
                )
            requests.append(req)
    if len(requests) < 2:
        raise ValueError(f"--trace {path}: needs at least 2 requests, found {len(requests)}")
    return requests


def native_rate(requests: list[TraceRequest]) -> float:
    """The trace's own mean arrival rate, req/s, over its span."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3
    if span_s <= 0:
        raise ValueError("--trace: every request has the same timestamp: no arrival rate to scale")
    return (len(requests) - 1) / span_s


class ScaledTrace(NamedTuple):
    """A trace ready for AIPerf's `mooncake_trace` dataset at one rate: its records and the block size
    (`--prompt-input-tokens-block-size`) its hash ids now stand for."""

    records: list[dict]
    block_size: int
    time_factor: float
    """Each gap between arrivals is multiplied by this (> 1: slower than recorded)."""
    clipped: int
    """Requests whose scaled prompt was cut to fit the context."""


CHAT_TEMPLATE_TOKENS = 64
"""Context a scaled request leaves free: AIPerf sends each prompt as a chat message, and the chat
template's role markers (12 tokens on the bench model) come on top of the trace's input length; a
prompt scaled to the last token of the context would be refused (400) by every server alike."""


def scale_trace(
    requests: list[TraceRequest], rate: float, input_mean: int, output_mean: int, max_context: int, id_range: int = 0
) -> ScaledTrace:
    """The trace at mean arrival rate `rate` (its timestamps stretched by one factor, so the arrival
    pattern, bursts included, is kept) with its lengths scaled by one factor each so that their means
    are about `input_mean` and `output_mean` tokens, every prompt + output within `max_context` less
    `CHAT_TEMPLATE_TOKENS`.

    One hash id now stands for B = round(512 x input factor) tokens, and the input factor is taken as
    exactly B / 512, so that a scaled prompt never needs more ids than the trace gave it (it keeps the
    leading ones: the prefix structure stays; the mean is off by the rounding of B). `id_range` n > 0
    moves every id into an n-th range of its own, so that a replay shares no prefix with an earlier
    replay of the same window on a server that still caches it."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    factor = native_rate(requests) / rate
    block = max(1, round(TRACE_BLOCK * input_mean / (sum(r.input_length for r in requests) / len(requests))))
    out_scale = output_mean / (sum(r.output_length for r in requests) / len(requests))
    offset = id_range * (max((h for r in requests for h in r.hash_ids), default=-1) + 1)
    t0 = requests[0].timestamp_ms
    records, clipped = [], 0
    room = max_context - CHAT_TEMPLATE_TOKENS
    if room < 2:
        raise ValueError(f"--max-context {max_context} leaves no room for a prompt and an output")
    for r in requests:
        out = max(1, min(round(r.output_length * out_scale), room - 1))
        length = max(1, round(r.input_length * block / TRACE_BLOCK))
        if length + out > room:
            length, clipped = room - out, clipped + 1
        records.append(
            {
                "timestamp": round((r.timestamp_ms - t0) * factor, 3),
                "input_length": length,
                "output_length": out,
                # AIPerf pads a prompt longer than its ids with fresh tokens (a trace listing only a prefix)
                "hash_ids": [h + offset for h in r.hash_ids[: math.ceil(length / block)]],
            }
        )
    return ScaledTrace(records, block, factor, clipped)
