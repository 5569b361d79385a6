"""Router-side request metrics: what the client sees, end to end, across retries and migrations.

The nodes measure their own engine (vllm:* with `engine="0"`); the router observes the stream it
hands to the client under the same vLLM names with `engine="router"` (TTFT includes routing,
prefill, KV transfer and any retry), which is what an SLO is written against. Every series
carries `model_name`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Gauge

from pdserve.node_runtime.vllm_metrics import RequestFamilies
from pdserve.router.request_window import RequestWindow
from pdserve.v1 import decode_pb2

ENGINE = "router"
"""The `engine` label of the router's vllm:* series: select or exclude them with it."""


class RequestMetrics:
    """vllm:* request series as the client sees them; `track` wraps one generation stream."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int = 2048,
        window: RequestWindow | None = None,
    ) -> None:
        """`window`: also keeps each finished request's TTFT and TPOT there (the SLO planner's input)."""
        self.window = window
        self.families = RequestFamilies(registry, model_name, ENGINE, max_model_len)
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "generation streams open now", ["model_name"], registry=registry
        ).labels(model_name)
        self.model_name = model_name

    async def track(
        self, events: AsyncIterator[decode_pb2.GenerateEvent], started: float | None = None
    ) -> AsyncIterator[decode_pb2.GenerateEvent]:
        """Yield `events` (Cluster.generate's) unchanged while observing latency, tokens and how the
        stream ended (the last event's reason and usage); `started` (monotonic): when the request
        arrived, so time in the admission queue counts."""
        clock = self.families.clock(0, started)
        reason = "abort"  # a consumer that stops early (client gone) ends the stream without a reason
        generated: int | None = None
        self.in_flight.inc()
        try:
            async for event in events:
                clock.tokens(len(event.token_ids))
                if event.finish_reason:  # the last event: its usage is set
                    clock.prompt(event.usage.prompt_tokens)
                    generated = event.usage.completion_tokens
                    reason = event.finish_reason if event.finish_reason in ("stop", "length") else "abort"
                yield event
        except Exception:
            reason = "error"
            raise
        finally:
            self.in_flight.dec()
            clock.finish(reason, generated)
            if self.window is not None:
                self.window.finished(clock.started, clock.first, clock.last, clock.num_tokens, time.monotonic())
