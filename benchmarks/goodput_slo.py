"""The pure half of benchmarks/goodput.py: SLO attainment from AIPerf's per-request records, and the
bounded search on request rate for goodput (DistServe's metric: the highest rate at which at least
a given share of requests meets both a TTFT and a TPOT SLO).

Nothing here starts a server or a client, so it is unit-tested without AIPerf or vLLM.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from benchmarks.common import pct
from pdserve.planner.config import SLO as Slo  # the SLOs `pdserve plan` predicts against, checked alike


class Outcome(NamedTuple):
    """One request as the client saw it; a failed request has `ok` False and NaN latencies."""

    ok: bool
    ttft_s: float
    tpot_s: float
    output_tokens: int
    prompt_tokens: int = 0
    """The prompt as the server counted it (AIPerf's ISL with server token counts: the chat template
    included), what `pdserve plan --input-len` means; 0 when not reported."""


def _value(metrics: dict, name: str) -> float:
    entry = metrics.get(name)
    return float(entry["value"]) if isinstance(entry, dict) and entry.get("value") is not None else math.nan


def outcome_of(record: dict) -> Outcome:
    """One line of AIPerf's `profile_export.jsonl`: its metrics are `{"name": {"value": v, "unit": "ms"}}`;
    a failed or cancelled request carries `error` (and no latency metrics). TPOT is computed here from
    the request's latency, TTFT and output length, not read from AIPerf's aggregate."""
    metrics = record.get("metrics") or {}
    cancelled = bool((record.get("metadata") or {}).get("was_cancelled"))
    ttft_ms, latency_ms = _value(metrics, "time_to_first_token"), _value(metrics, "request_latency")
    tokens = _value(metrics, "output_sequence_length")
    prompt = _value(metrics, "input_sequence_length")
    if math.isnan(tokens):
        tokens = _value(metrics, "output_token_count")
    if record.get("error") or cancelled or math.isnan(ttft_ms) or math.isnan(tokens) or tokens < 1:
        return Outcome(False, math.nan, math.nan, 0)
    if tokens > 1 and not math.isnan(latency_ms):
        tpot_s = (latency_ms - ttft_ms) / 1e3 / (tokens - 1)
    elif tokens > 1:  # no end-to-end latency reported: AIPerf's own per-request ITL is the same quantity
        tpot_s = _value(metrics, "inter_token_latency") / 1e3
    else:
        tpot_s = 0.0  # one token: nothing after the first
    return Outcome(True, ttft_ms / 1e3, tpot_s, int(tokens), 0 if math.isnan(prompt) else int(prompt))


def failure_reasons(records: list[dict], limit: int = 5) -> dict[str, int]:
    """Why requests failed, as AIPerf recorded it (`error`: code, type, message), counted by reason:
    the `limit` most common, so that a failed request in a result says whether the server refused
    it, dropped its stream or the client gave up waiting."""
    reasons: Counter[str] = Counter()
    for error in (record.get("error") for record in records):
        if not error:
            continue
        if isinstance(error, dict):
            head = " ".join(str(error[k]) for k in ("code", "type") if error.get(k) is not None)
            text = f"{head}: {error.get('message') or ''}".strip(": ")
        else:
            text = str(error)
        reasons[" ".join(text.split())[:160]] += 1
    return dict(reasons.most_common(limit))


def profiling_records(records: list[dict]) -> list[dict]:
    """The records of the measured phase (AIPerf tags warm-up requests `benchmark_phase: warmup`)."""
    return [r for r in records if (r.get("metadata") or {}).get("benchmark_phase", "profiling") == "profiling"]


def meets(o: Outcome, slo: Slo) -> bool:
    return o.ok and o.ttft_s <= slo.ttft_s and o.tpot_s <= slo.tpot_s


def attainment(outcomes: list[Outcome], slo: Slo, sent: int) -> float:
    """The share of the `sent` requests that met both SLOs. Failed requests, and requests that left
    no record at all (sent > records), count as misses; 0 when nothing was sent."""
    total = max(sent, len(outcomes))
    return sum(meets(o, slo) for o in outcomes) / total if total else 0.0


def summarize(outcomes: list[Outcome], slo: Slo, sent: int) -> dict:
    """Attainment and the latency percentiles behind it (seconds), for one run at one rate."""
    done = [o for o in outcomes if o.ok]
    ttft, tpot = [o.ttft_s for o in done], [o.tpot_s for o in done]
    prompts = [o.prompt_tokens for o in done if o.prompt_tokens > 0]

    def r(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    return {
        "attainment": round(attainment(outcomes, slo, sent), 4),
        "sent": max(sent, len(outcomes)),
        "failed": max(sent, len(outcomes)) - len(done),
        "ttft_p50_s": r(pct(ttft, 0.5)),
        "ttft_p90_s": r(pct(ttft, 0.9)),
        "tpot_p50_s": r(pct(tpot, 0.5)),
        "tpot_p90_s": r(pct(tpot, 0.9)),
        # what to give `pdserve plan --input-len` for this load: the server's count, template included
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
    }


class Step(NamedTuple):
    """One run of the search: the rate tried and the attainment it measured."""

    rate: float
    attainment: float
    passed: bool


class Search(NamedTuple):
    """The search's answer: goodput (the highest rate that passed; 0.0 when none did), the lowest rate
    that failed (None: none did, so goodput is only a lower bound), and every step."""

    goodput: float
    lowest_fail: float | None
    steps: list[Step]


def search_goodput(
    measure: Callable[[float], float], start: float, max_steps: int, threshold: float, rel_tol: float = 0.1
) -> Search:
    """Goodput by a bounded search on rate, each step one fresh `measure(rate)` (the attainment at it).

    From `start`, the rate doubles while runs pass and halves while they fail, until one pass and one
    fail bracket the answer; then it bisects (geometric midpoint: rates span decades) until the bracket
    is within `rel_tol` or `max_steps` runs were made. Attainment is assumed to fall as rate rises; a
    noisy non-monotone step only narrows the bracket on its side, it never raises the answer above a
    rate that was measured to pass."""
    if not start > 0:
        raise ValueError(f"--start-rate must be > 0 req/s, got {start}")
    if max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {max_steps}")
    steps: list[Step] = []
    best_pass, lowest_fail = 0.0, math.inf
    rate = start
    while len(steps) < max_steps:
        got = measure(rate)
        passed = got >= threshold
        steps.append(Step(rate, got, passed))
        if passed:
            best_pass = max(best_pass, rate)
        else:
            lowest_fail = min(lowest_fail, rate)
        if best_pass == 0.0:
            rate = rate / 2  # nothing passed yet: look lower
        elif math.isinf(lowest_fail):
            rate = rate * 2  # nothing failed yet: look higher
        elif lowest_fail <= best_pass * (1 + rel_tol):
            break  # bracketed closely enough
        else:
            rate = math.sqrt(best_pass * lowest_fail)
    return Search(best_pass, None if math.isinf(lowest_fail) else lowest_fail, steps)
