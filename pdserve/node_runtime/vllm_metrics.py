"""vLLM's request-level Prometheus families, with vLLM's names, types, label sets and buckets.

Dashboards, alerts and scrapers written for vLLM (vllm/v1/metrics/loggers.py) read these
directly: no recording rule in between. Nodes bind them to `engine="0"` (one engine per
process, as a vLLM pod); the router binds them to `engine="router"` and observes the stream
the client sees. `RequestClock` turns one request's events into observations.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile over a mix of vLLM and pdserve
# pods, or a dashboard's fixed `le` thresholds, mean the same thing.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TTFT_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
)
TOKEN_LATENCY_BUCKETS += (10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
REQUEST_LATENCY_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class RequestFamilies:
    """The vllm:* request series of one engine (or of the router), bound to (model_name, engine)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str, max_model_len: int) -> None:
        values = (model_name, engine)

        def bound(kind: type[Histogram] | type[Counter], name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, LABELS, registry=registry, **kw).labels(*values)

        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.ttft = bound(Histogram, "vllm:time_to_first_token_seconds", "time to first token", buckets=TTFT_BUCKETS)
        self.itl = bound(
            Histogram, "vllm:inter_token_latency_seconds", "inter-token latency", buckets=TOKEN_LATENCY_BUCKETS
        )
        # vLLM 0.9-0.10 observe the same per-token gap under this (deprecated) name; production-stack's
        # dashboard still reads it.
        self.tpot = bound(
            Histogram, "vllm:time_per_output_token_seconds", "time per output token", buckets=TOKEN_LATENCY_BUCKETS
        )
        self.e2e = bound(
            Histogram, "vllm:e2e_request_latency_seconds", "e2e request latency", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.queue = bound(
            Histogram, "vllm:request_queue_time_seconds", "time in WAITING phase", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.prefill = bound(
            Histogram, "vllm:request_prefill_time_seconds", "time in PREFILL phase", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.decode = bound(
            Histogram, "vllm:request_decode_time_seconds", "time in DECODE phase", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.inference = bound(
            Histogram, "vllm:request_inference_time_seconds", "time in RUNNING phase", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt = bound(
            Histogram, "vllm:request_prompt_tokens", "prompt tokens per request", buckets=token_buckets
        )
        self.request_generation = bound(
            Histogram, "vllm:request_generation_tokens", "generated tokens per request", buckets=token_buckets
        )
        self.request_tpot = bound(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "decode time / (generated tokens - 1), per request",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.max_generation = bound(
            Histogram,
            "vllm:request_max_num_generation_tokens",
            "maximum number of requested generation tokens",
            buckets=token_buckets,
        )
        self.max_tokens = bound(
            Histogram, "vllm:request_params_max_tokens", "the max_tokens request parameter", buckets=token_buckets
        )
        self.prompt_tokens = bound(Counter, "vllm:prompt_tokens", "prefill tokens processed")
        self.generation_tokens = bound(Counter, "vllm:generation_tokens", "generation tokens processed")
        success = Counter(
            "vllm:request_success", "finished requests by reason", LABELS + ["finished_reason"], registry=registry
        )
        # children for every reason exist from the start, so rate() works before the first finish
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

    def clock(self, prompt_tokens: int, started: float | None = None, max_tokens: int | None = None) -> RequestClock:
        """A clock for one request that arrived at `started` (default: now), asking for up to
        `max_tokens` (None: not known here)."""
        return RequestClock(self, prompt_tokens, time.monotonic() if started is None else started, max_tokens)


class RequestClock:
    """One request's timeline: arrival, queue wait, first token, each later token, end.

    Token gaps are observed per token: a step or a stream chunk that carries n tokens after a gap
    of g seconds counts as n gaps of g/n (vLLM observes per token, not per delivery).
    """

    def __init__(
        self, families: RequestFamilies, prompt_tokens: int, started: float, max_tokens: int | None = None
    ) -> None:
        self.f = families
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.queue_seconds: float | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.done = False
        self._prompt_counted = 0

    def prompt(self, num_tokens: int) -> None:
        """The prompt's length, learnt late (the router reads it from the final usage): vllm:prompt_tokens
        gets the difference if the first token already counted the old value."""
        self.prompt_tokens = num_tokens
        if self.first is not None:
            self.f.prompt_tokens.inc(max(0, num_tokens - self._prompt_counted))
            self._prompt_counted = max(num_tokens, self._prompt_counted)

    def queued(self, seconds: float) -> None:
        """The request waited `seconds` before it first ran (observed once)."""
        if self.queue_seconds is None:
            self.queue_seconds = seconds
            self.f.queue.observe(seconds)

    def tokens(self, n: int, now: float | None = None) -> None:
        """`n` new tokens reached this point of the pipeline at `now`."""
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            self.f.ttft.observe(now - self.started)
            self.f.prompt_tokens.inc(self.prompt_tokens)
            self._prompt_counted = self.prompt_tokens
            gaps, gap = 0, 0.0  # tokens delivered with the first one have no gap of their own to measure
        else:
            gaps, gap = n, (now - (self.last or now)) / n
        for _ in range(gaps):
            self.f.itl.observe(gap)
            self.f.tpot.observe(gap)
        self.last = now
        self.num_tokens += n
        self.f.generation_tokens.inc(n)

    def finish(self, reason: str | None, num_generated: int | None = None, now: float | None = None) -> None:
        """The request ended with `reason` (stop, length; anything else counts as abort or error).
        A request that never produced a token counts only in request_success."""
        if self.done:
            return
        self.done = True
        reason = reason if reason in FINISH_REASONS else "abort"
        self.f.success[reason].inc()
        if self.first is None:
            return
        now = time.monotonic() if now is None else now
        ran_at = self.started + (self.queue_seconds or 0.0)
        prefill = max(0.0, self.first - ran_at)
        decode = max(0.0, (self.last or self.first) - self.first)
        self.f.e2e.observe(now - self.started)
        self.f.prefill.observe(prefill)
        self.f.decode.observe(decode)
        self.f.inference.observe(prefill + decode)
        generated = self.num_tokens if num_generated is None else num_generated
        self.f.request_prompt.observe(self.prompt_tokens)
        self.f.request_generation.observe(generated)
        if generated > 1:
            self.f.request_tpot.observe(decode / (generated - 1))
        if self.max_tokens is not None:
            self.f.max_generation.observe(self.max_tokens)
            self.f.max_tokens.observe(self.max_tokens)
