"""Synthetic ShareGPT-like workloads for the simulator.

No dataset can be downloaded on these machines, so lengths are drawn from
log-normal distributions shaped like ShareGPT V3 after the paper's filter
(inputs < 1024 tokens): input median 160 (sigma 1.0, clipped to [4, 1023]),
output median 180 (sigma 1.0, clipped to [1, 1024]). The predicted length mimics
the paper's predictor: the mean of the true length's percentile bucket with
probability `predictor_accuracy` (0.55, the paper reports 0.52–0.58), otherwise
the mean of a neighbouring bucket.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from pdserve.tdpipe.config import require_positive


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of the synthetic workload."""

    num_requests: int = 5000
    """Requests in the offline job."""
    input_median: int = 160
    input_sigma: float = 1.0
    max_input: int = 1023
    output_median: int = 180
    output_sigma: float = 1.0
    max_output: int = 1024
    predictor_accuracy: float = 0.55
    """Probability that the simulated prediction hits the true bucket."""
    seed: int = 0
    """Seed of the synthetic workload's random generator."""

    def __post_init__(self) -> None:
        require_positive(self, "num_requests", "input_median", "output_median")
        if not 0.0 <= self.predictor_accuracy <= 1.0:
            raise ValueError(f"predictor_accuracy must be in [0, 1], got {self.predictor_accuracy}")


@dataclass
class SimRequest:
    """One request's simulated state (mutable: the simulator advances it)."""

    request_id: int | str
    """An int in the simulator; the real pipeline's PipeRequest uses the batch line's custom_id."""
    input_len: int
    output_len: int
    predicted_len: int
    num_generated: int = 0
    num_prefilled: int = 0
    """Prompt tokens already prefilled (chunked prefill)."""
    finish_ms: float = field(default=-1.0)

    @property
    def kv_len(self) -> int:
        return self.input_len + self.num_generated

    @property
    def finished(self) -> bool:
        return self.num_generated >= self.output_len

    def preempt(self) -> None:
        """Recompute preemption: the generated tokens join the prompt, KV is dropped."""
        self.input_len += self.num_generated
        self.output_len -= self.num_generated
        self.predicted_len = max(1, self.predicted_len - self.num_generated)
        self.num_generated = 0
        self.num_prefilled = 0


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def generate(config: WorkloadConfig) -> list[SimRequest]:
    rng = random.Random(config.seed)
    pairs = [
        (
            _lognormal(rng, config.input_median, config.input_sigma, 4, config.max_input),
            _lognormal(rng, config.output_median, config.output_sigma, 1, config.max_output),
        )
        for _ in range(config.num_requests)
    ]
    outputs = sorted(o for _, o in pairs)
    edges = [outputs[min(len(outputs) - 1, int(p / 100 * len(outputs)))] for p in (25, 50, 75, 90, 99)]
    buckets: list[list[int]] = [[] for _ in range(len(edges) + 1)]
    for o in outputs:
        buckets[sum(1 for e in edges if o >= e)].append(o)
    means = [sum(b) / len(b) if b else outputs[len(outputs) // 2] for b in buckets]
    requests = []
    for i, (inp, out) in enumerate(pairs):
        bucket = sum(1 for e in edges if out >= e)
        if rng.random() >= config.predictor_accuracy:
            bucket = min(len(means) - 1, max(0, bucket + rng.choice((-1, 1))))
        requests.append(SimRequest(i, inp, out, max(1, round(means[bucket]))))
    return requests
