"""A live view of a running pipeline, for progress lines and metrics (`pdserve batch --enable-metrics`).

The controller updates it as batches enter and leave (`StageExecutor`); any thread may read it.
The stages' own timelines, which give the exact bubble fraction, reach the controller only at the
end of the job, so while it runs the bubble is estimated from the controller's side: a pipeline of
S stages is kept full by S batches in flight, and each moment with k < S in flight leaves S - k
stages without work (phase switches, the refill after a prefill phase, a policy that holds back).
"""

from __future__ import annotations

import threading
import time


class PipelineGauge:
    """Phase, tokens, batches and an estimated bubble fraction of one pipeline run."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.phase = "starting"
        """The phase of the batch the policy submitted last: prefill, decode or hybrid."""
        self.output_tokens = 0
        self.batches_done = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()
        self._busy = 0.0
        """Integral over time of min(in_flight, S) / S: stage-seconds with work, per stage."""

    def _advance(self, now: float) -> None:
        self._busy += (now - self._last) * min(self.in_flight, self.num_stages) / self.num_stages
        self._last = now

    def on_submit(self, phase: str) -> None:
        with self._lock:
            self._advance(time.monotonic())
            self.in_flight += 1
            self.phase = phase

    def on_complete(self, sampled: int) -> None:
        with self._lock:
            self._advance(time.monotonic())
            self.in_flight -= 1
            self.batches_done += 1
            self.output_tokens += sampled

    @property
    def bubble_fraction(self) -> float:
        """Estimated share of stage time without a batch since the first batch (0 before it)."""
        with self._lock:
            self._advance(time.monotonic())
            span = self._last - self._t0
            return 1.0 - self._busy / span if span > 0 and self.batches_done + self.in_flight else 0.0

    def start(self) -> None:
        """Start the clock when the first batch can be sent (the stages have joined and loaded)."""
        with self._lock:
            self._t0 = self._last = time.monotonic()
            self._busy = 0.0
