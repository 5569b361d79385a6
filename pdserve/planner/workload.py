"""The requests a plan is made for, and when they arrive at a given rate.

Lengths come from a trace (`.jsonl` lines with `timestamp` in ms, `input_length`, `output_length`,
as `../shared/traces/`) or from a mean and a spread per length. Arrival times at rate `r` are
either Poisson (DistServe's search) or the trace's own timestamps compressed or stretched to mean
rate `r`, keeping its bursts. Both are drawn once per workload and only scaled per rate, so two
rates see the same requests in the same order (a fair comparison, and a monotone search).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

Arrival = Literal["poisson", "trace"]


class Lengths(NamedTuple):
    """One request's prompt and output length in tokens (both >= 1)."""

    input_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Requests, in arrival order, and the unit-rate arrival times they are scaled from."""

    requests: tuple[Lengths, ...]
    unit_times: tuple[float, ...]
    """Arrival time of each request at a mean rate of 1 request/s (the first at 0)."""
    poisson_seed: int | None = None
    """The seed `unit_times` were drawn with, when they are Poisson arrivals (None: a trace's own
    timestamps). `at_least` then goes on drawing from it rather than repeating them."""

    def __post_init__(self) -> None:
        assert len(self.requests) == len(self.unit_times) >= 1, "one arrival time per request, at least one"

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times in seconds at mean rate `rate` requests/s."""
        return [t / rate for t in self.unit_times]

    def at_least(self, num_requests: int) -> "Workload":
        """The requests repeated until there are `num_requests` (a short workload only shows a burst,
        which a big cluster absorbs). Poisson arrivals go on as the same Poisson process (repeating a
        short sample would make one lucky or unlucky draw periodic: the goodput of 32 requests
        repeated varied by 40% between seeds); a trace's timestamps repeat, each round after the
        last at the mean unit gap of 1 s."""
        if num_requests <= len(self.requests):
            return self
        if self.poisson_seed is not None:
            reps = -(-num_requests // len(self.requests))
            drawn = poisson_unit_times(reps * len(self.requests), self.poisson_seed)[:num_requests]
            return Workload((self.requests * reps)[:num_requests], drawn, self.poisson_seed)
        requests, times = list(self.requests), list(self.unit_times)
        period = self.unit_times[-1] + 1.0
        while len(requests) < num_requests:
            k = len(requests) // len(self.requests)
            take = min(len(self.requests), num_requests - len(requests))
            requests += self.requests[:take]
            times += [t + k * period for t in self.unit_times[:take]]
        return Workload(tuple(requests), tuple(times))

    @property
    def mean_input(self) -> float:
        return sum(r.input_len for r in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(r.output_len for r in self.requests) / len(self.requests)


def poisson_unit_times(n: int, seed: int) -> tuple[float, ...]:
    """`n` Poisson arrivals at rate 1, the first at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0)
    return tuple(out)


def read_trace(path: str | Path) -> list[tuple[float, Lengths]]:
    """Every (timestamp in ms, lengths) of a trace; ValueError naming the line when a timestamp
    runs backwards or a field is missing or not positive (out of order, the replay would be wrong)."""
    rows: list[tuple[float, Lengths]] = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ts, lengths = float(obj["timestamp"]), Lengths(int(obj["input_length"]), int(obj["output_length"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {lineno}: not a trace record ({e})") from None
            if min(lengths) < 1:
                raise ValueError(f"{path} line {lineno}: lengths must be >= 1, got {tuple(lengths)}")
            if rows and ts < rows[-1][0]:
                raise ValueError(
                    f"{path} line {lineno}: timestamp {ts:g} is before the previous line's {rows[-1][0]:g}"
                )
            rows.append((ts, lengths))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def from_trace(path: str | Path, num_requests: int, arrival: Arrival, seed: int) -> Workload:
    """The first `num_requests` requests of a trace (the whole trace is checked for order)."""
    rows = read_trace(path)[:num_requests]
    if arrival == "poisson":
        return Workload(tuple(r for _, r in rows), poisson_unit_times(len(rows), seed), seed)
    span_s = (rows[-1][0] - rows[0][0]) / 1000.0
    if len(rows) < 2 or span_s <= 0:
        raise ValueError(f"{path}: its first {len(rows)} requests arrive at one instant: no rate to scale")
    native_rate = (len(rows) - 1) / span_s
    return Workload(tuple(r for _, r in rows), tuple((ts - rows[0][0]) / 1000.0 * native_rate for ts, _ in rows))


def spread_lengths(mean: int, spread: float, n: int, rng: random.Random) -> list[int]:
    """`n` lengths uniform in mean * [1 - spread, 1 + spread], at least 1."""
    lo, hi = mean * (1.0 - spread), mean * (1.0 + spread)
    return [max(1, round(rng.uniform(lo, hi))) for _ in range(n)]


def from_lengths(input_len: int, output_len: int, spread: float, num_requests: int, seed: int) -> Workload:
    """`num_requests` requests around the given mean lengths, arriving as a Poisson process."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"lengths must be >= 1, got input {input_len}, output {output_len}")
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    if num_requests < 1:
        raise ValueError(f"need at least one request, got {num_requests}")
    rng = random.Random(seed)
    ins = spread_lengths(input_len, spread, num_requests, rng)
    outs = spread_lengths(output_len, spread, num_requests, rng)
    lengths = tuple(Lengths(i, o) for i, o in zip(ins, outs))
    return Workload(lengths, poisson_unit_times(num_requests, seed + 1), seed + 1)
