"""Spatial-temporal intensity comparison: when to switch from decode back to prefill."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.tdpipe.cost_table import CostTable


class IntensityDecision(NamedTuple):
    spatial: float
    temporal: float
    switch_to_prefill: bool


def spatial_intensity(table: CostTable, batch_size: int, ref_batch_size: int = 256) -> float:
    """Achieved / peak per-request decode throughput at `batch_size` (clamped to 1).

    Peak is the per-request throughput at `ref_batch_size`: in the paper a batch
    large enough to saturate the device (256 in the authors' normalisation). The
    TD-Pipe controller passes the smaller of that and `phase_peak_batch_size`,
    because when the KV capacity holds fewer requests than that per batch, a
    saturating batch is unreachable and a ratio to it reads as a loss that no
    switch to prefill can recover (see docs/tdpipe.md).
    """
    if batch_size <= 0:
        return 0.0
    peak = table.per_request_throughput(ref_batch_size)
    return min(1.0, table.per_request_throughput(batch_size) / peak)


def phase_peak_batch_size(batch_size: int, done_ratio: float) -> int:
    """Per-batch decode size at the start of the current decode phase.

    `batch_size` requests per batch are left after `done_ratio` of the phase's
    requests finished, so the phase started with about batch_size / (1 − done_ratio).
    That is the batch the KV capacity allowed the last refill, and so about what a
    switch to prefill can restore: the next greedy prefill again stops when the
    predicted KV usage reaches capacity.
    """
    if batch_size <= 0 or done_ratio >= 1.0:
        return max(1, batch_size)
    return max(1, round(batch_size / (1.0 - max(0.0, done_ratio))))


def temporal_intensity(
    pending_prefill_ms: list[float], decode_step_ms: float, num_stages: int, refill: bool = True
) -> float:
    """1 − bubble/total for switching to prefill now (paper §3.5), per-stage times.

    bubble = (longest pending prefill − current decode step), what downstream stages
    idle while the slowest prefill follows the shorter decode steps, plus — our
    addition, see below — the refill when decode resumes: the first decode batch
    waits for the last prefill to leave the last stage, (num_stages − 1) prefill
    stage-times. total = all pending prefills + one decode step per batch + bubble.
    Without the refill term a single short pending prefill gives bubble 0 and
    intensity 1, and the simulated controller switched on almost every batch return
    (hundreds of phase switches per 1,000 requests). `refill=False` drops the term
    (the paper's bubble; kept for the ablation in benchmarks/tdpipe_intensity.py).
    With nothing to prefill, switching gains nothing, so the intensity is 0.
    """
    if not pending_prefill_ms:
        return 0.0
    longest = max(pending_prefill_ms)
    bubble = max(0.0, longest - decode_step_ms) + ((num_stages - 1) * longest if refill else 0.0)
    total = sum(pending_prefill_ms) + num_stages * decode_step_ms + bubble
    return 1.0 - bubble / total


def decide(
    table: CostTable,
    batch_size: int,
    pending_prefill_ms: list[float],
    decode_step_ms: float,
    num_stages: int,
    ref_batch_size: int = 256,
    refill: bool = True,
    phase_done_ratio: float | None = None,
) -> IntensityDecision:
    """Switch to prefill when spatial intensity < temporal intensity.

    With `phase_done_ratio` (the fraction of this decode phase's requests that have
    finished), peak is taken at min(`ref_batch_size`, `phase_peak_batch_size`): the
    batch a switch can restore. Without it, at `ref_batch_size` (the paper's rule).
    """
    if phase_done_ratio is not None:
        ref_batch_size = min(ref_batch_size, phase_peak_batch_size(batch_size, phase_done_ratio))
    s = spatial_intensity(table, batch_size, ref_batch_size)
    t = temporal_intensity(pending_prefill_ms, decode_step_ms, num_stages, refill)
    return IntensityDecision(s, t, s < t)
