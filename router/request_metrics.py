"""Router-side request metrics: what the client sees, end to end, across retries and migrations.

The nodes measure their own phases; these series measure the stream the router
hands to the client (TTFT includes routing, prefill, KV transfer and any retry),
which is what an SLO is written against. Every series carries `model_name`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.cluster import GenerateChunk

# Latency buckets up to 10 minutes: a long generation's end-to-end time must not fall into +Inf.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RequestMetrics:
    """pdserve_router_* request series; `track` wraps one generation stream."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def series(kind: type[Histogram | Gauge | Counter], name: str, doc: str, **kw: Any) -> Any:
            """One series in `registry`, bound to this router's `model_name`."""
            return kind(name, doc, ["model_name"], registry=registry, **kw).labels(model_name)

        self.ttft = series(
            Histogram,
            "pdserve_router_time_to_first_token_seconds",
            "request arrival to first token, as the client sees it",
            buckets=LATENCY_BUCKETS,
        )
        self.itl = series(
            Histogram,
            "pdserve_router_inter_token_latency_seconds",
            "time between streamed token chunks",
            buckets=ITL_BUCKETS,
        )
        self.e2e = series(
            Histogram,
            "pdserve_router_e2e_request_latency_seconds",
            "request arrival to last token",
            buckets=LATENCY_BUCKETS,
        )
        self.in_flight = series(Gauge, "pdserve_router_requests_in_flight", "generation streams open now")
        self.prompt_tokens = series(Counter, "pdserve_router_prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = series(Counter, "pdserve_router_generation_tokens", "tokens generated (streamed)")
        self.prefix_cache_queries = series(
            Counter, "pdserve_router_prefix_cache_queries", "prompt tokens looked up in the decode prefix cache"
        )
        self.prefix_cache_hits = series(
            Counter, "pdserve_router_prefix_cache_hits", "prompt tokens found in the decode prefix cache"
        )
        self._finished = Counter(
            "pdserve_router_requests_finished",
            "finished generations by finish reason",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort", "error"):  # export zeros so rate() works from the start
            self._finished.labels(model_name, reason)

    async def track(self, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
        """Yield `chunks` unchanged while observing latency, tokens and how the stream ended."""
        started = last = time.monotonic()
        first = True
        reason = "abort"  # a consumer that stops early (client gone) ends the stream without a reason
        self.in_flight.inc()
        try:
            async for chunk in chunks:
                now = time.monotonic()
                if chunk.token_ids:
                    (self.ttft if first else self.itl).observe(now - (started if first else last))
                    first, last = False, now
                    self.generation_tokens.inc(len(chunk.token_ids))
                if chunk.finish_reason:
                    reason = chunk.finish_reason if chunk.finish_reason in ("stop", "length") else "abort"
                if chunk.usage is not None:
                    self.prompt_tokens.inc(chunk.usage.prompt_tokens)
                    self.prefix_cache_queries.inc(chunk.usage.prompt_tokens)
                    self.prefix_cache_hits.inc(chunk.usage.cached_tokens)
                yield chunk
        except Exception:
            reason = "error"
            raise
        finally:
            self.in_flight.dec()
            self.e2e.observe(time.monotonic() - started)
            self._finished.labels(self.model_name, reason).inc()
