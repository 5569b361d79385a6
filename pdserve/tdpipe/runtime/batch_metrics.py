"""`pdserve batch --enable-metrics --port N`: Prometheus series of the running job.

Counters follow the lines written (a line's usage is what its output says); the phase and the
bubble fraction are read from the controller's executor: its live gauge (`executor.gauge`) where
the runtime keeps one, else sampled here every 100 ms. Either way the bubble is estimated from how
many batches are in flight (a stage is idle whenever fewer than `stages` batches are in the
pipeline); when the job ends it is set to the exact figure from the stages' own timelines.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from pdserve.tdpipe.runtime.controller import StageExecutor

PHASES = ("starting", "prefill", "decode", "hybrid", "done")
SAMPLE_S = 0.1


class BatchMetrics:
    """The job's series on a private registry, served on `port` (127.0.0.1 unless `host` says)."""

    def __init__(self, model_name: str, stages: int) -> None:
        self.registry = CollectorRegistry()
        self.stages = stages
        labels = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**labels)

        self.done = counter("pdserve_batch_requests_done", "Input lines answered with a 200 response")
        self.failed = counter("pdserve_batch_requests_failed", "Input lines answered with an error line")
        self.prompt_tokens = counter("pdserve_batch_prompt_tokens", "Prompt tokens of the answered lines")
        self.generation_tokens = counter("pdserve_batch_generation_tokens", "Tokens generated for answered lines")
        self.in_flight = Gauge(
            "pdserve_batch_lines_in_flight",
            "Lines read, output not yet written",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self.phase = Gauge(
            "pdserve_batch_phase",
            "1 for the phase of the batch submitted last",
            ["model_name", "phase"],
            registry=self.registry,
        )
        self.bubble = Gauge(
            "pdserve_batch_bubble_fraction",
            "Share of stage time spent idle so far (estimate while running)",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self._labels = labels
        self._busy = self._total = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.set_phase("starting")

    def serve(
        self, port: int, host: str, executor: Callable[[], StageExecutor | None], in_flight: Callable[[], int]
    ) -> None:
        """Start the HTTP endpoint and the sampler of `executor()` (None until the stages join)."""
        start_http_server(port, addr=host, registry=self.registry)
        self._thread = threading.Thread(
            target=self._sample, args=(executor, in_flight), daemon=True, name="batch-metrics"
        )
        self._thread.start()

    def observe(self, row: dict) -> None:
        """Count one written output line."""
        resp = row.get("response") or {}
        if resp.get("status_code") != 200:
            self.failed.inc()
            return
        self.done.inc()
        usage = resp["body"].get("usage") or {}
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.generation_tokens.inc(usage.get("completion_tokens", 0))

    def set_phase(self, phase: str) -> None:
        for p in PHASES:
            self.phase.labels(phase=p, **self._labels).set(1.0 if p == phase else 0.0)

    def finish(self, bubble_fraction: float | None) -> None:
        """The job ended: the exact bubble fraction from the stage timelines, phase `done`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if bubble_fraction is not None:
            self.bubble.set(bubble_fraction)
        self.set_phase("done")

    def _sample(self, executor: Callable[[], StageExecutor | None], in_flight: Callable[[], int]) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.in_flight.set(in_flight())
            ex = executor()
            if ex is None:
                continue
            gauge = getattr(ex, "gauge", None)
            if gauge is not None:  # the runtime's own live view: exact time integral
                self.set_phase(gauge.phase)
                self.bubble.set(gauge.bubble_fraction)
                continue
            decisions = ex.decisions
            if decisions:
                self.set_phase(decisions[-1][0])
            # every stage is busy while `stages` batches are in the pipeline, one fewer per missing batch
            self._busy += min(len(ex.inflight), self.stages) / self.stages
            self._total += 1
            self.bubble.set(1.0 - self._busy / self._total)
