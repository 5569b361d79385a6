"""A profile of the pipeline's stages (`StageProfile`, measured by `profile.py`) as the simulator's `CostTable`.

Mapping onto the simulator (read `tdpipe/cost_table.py` and `tdpipe/pipeline.py`):
`CostTable.stage_ms(n, S) = forward_ms(n) / S`, and the simulated pipeline is a
flow shop of S *equal* stages. The real stages are not equal (the last one also
runs the LM head; the split weighs it, `stage_split`, but moves whole layers), and
in a pipeline kept full the slowest stage sets the pace,
so a table entry is `S * max_k stage_k(n)`: `stage_ms` then returns the
bottleneck stage's measured time. The table has one token dimension for both
phases, so it holds the decode curve (a step of a batch of `n` requests, measured
at one representative KV length; a real decode step grows with the KV length,
which the overheads' per-stage KV slopes add: `PipelineOverheads.decode_kv_ms`)
for `n` up to a cut, the largest decode batch the policies
form, and the prefill curve (`n` prompt tokens in whole prompts) above it; a monotone
least-squares fit (`monotone`) keeps the table non-decreasing, where the two curves meet too. Prefill
batches below the cut are priced as decode steps (dearer per token on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Phase
from pdserve.tdpipe.runtime.profile_comm import pipeline_overheads


@dataclass
class StageProfile:
    """Measured forward times (ms, median of repeats) of one stage."""

    stage: int
    layer_range: tuple[int, int]
    """The layers the stage holds (both of its ranges under the phase split)."""
    decode_context: int
    """KV length (tokens per sequence) every decode measurement used."""
    decode_ms: dict[int, float] = field(default_factory=dict)
    """Decode step time by batch size (one new token per request)."""
    prefill_ms: dict[int, float] = field(default_factory=dict)
    """Prefill time by total prompt tokens (whole prompts of `prefill_prompt_len` tokens)."""
    handoff_ms: dict[int, float] = field(default_factory=dict)
    """Sending this stage's hidden states to the next, by tokens (empty on the last stage)."""
    dispatch_ms: dict[int, float] = field(default_factory=dict)
    """First stage only: the controller's round trip into it, by decode batch size (profile_comm)."""
    prefill_prompt_len: int = 0
    """Length of the whole prompts every prefill measurement used (0: not recorded)."""
    decode_kv_ms: float = 0.0
    """A decode step's extra ms per KV token read beyond `decode_context` per sequence: the largest
    decode batch timed again at twice the context (0: not measured)."""


def bottleneck_curve(profiles: list[StageProfile], phase: str) -> dict[int, float]:
    """Per token count, the slowest stage's time (ms) for `phase` (Phase.DECODE or Phase.PREFILL)."""
    curves = [p.decode_ms if phase == Phase.DECODE else p.prefill_ms for p in profiles]
    keys = set(curves[0])
    if any(set(c) != keys for c in curves):
        raise ValueError("every stage must be profiled at the same points")
    return {n: max(c[n] for c in curves) for n in sorted(keys)}


def _interp(curve: dict[int, float], n: int) -> float:
    """Linear interpolation of a profiled curve at `n` (clamped to its first/last point)."""
    keys = sorted(curve)
    if n <= keys[0]:
        return curve[keys[0]]
    for a, b in zip(keys, keys[1:]):
        if a <= n <= b:
            w = (n - a) / (b - a)
            return curve[a] * (1 - w) + curve[b] * w
    return curve[keys[-1]]


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares (pool adjacent violators).

    A bigger batch never costs less, but a noisy profile can say so; averaging a point that breaks
    the order with its neighbours keeps one slow measurement from raising every point after it, as
    a running max did (a decode step of 32 timed at 122 ms, then 96 ms at 41, on a busy VM)."""
    pools: list[tuple[float, int]] = []  # (sum, count) of runs of points that share one value
    for v in values:
        total, count = v, 1
        while pools and pools[-1][0] / pools[-1][1] > total / count:
            prev_total, prev_count = pools.pop()
            total, count = total + prev_total, count + prev_count
        pools.append((total, count))
    return [total / count for total, count in pools for _ in range(count)]


def build_cost_table(profiles: list[StageProfile], name: str = "profiled", decode_max: int | None = None) -> CostTable:
    """A CostTable whose `stage_ms(n, len(profiles))` is the bottleneck stage's measured time:
    the decode curve for n <= `decode_max` (default: the largest profiled decode batch; between
    profiled points it is interpolated), the prefill curve above it (module docstring).

    Prefill batches smaller than `decode_max` tokens are priced as decode steps, which on a
    CPU cost more per token (every sequence reads its KV): keep `decode_max` at the largest
    decode batch the policies actually form (see `tdpipe_runtime.py`)."""
    if not profiles:
        raise ValueError("no stage profiles")
    num_stages = len(profiles)
    decode, prefill = bottleneck_curve(profiles, Phase.DECODE), bottleneck_curve(profiles, Phase.PREFILL)
    cut = max(decode) if decode_max is None else decode_max
    if cut < 1:
        raise ValueError(f"decode_max must be >= 1, got {decode_max}")
    rows: dict[int, float] = {n: t for n, t in decode.items() if n < cut}
    rows[cut] = _interp(decode, cut)
    rows.update({n: t for n, t in prefill.items() if n > cut})
    tokens = sorted(rows)
    times = [t * num_stages for t in monotone([rows[n] for n in tokens])]
    over = pipeline_overheads(
        [p.decode_ms for p in profiles],
        [p.prefill_ms for p in profiles],
        profiles[0].handoff_ms,
        profiles[0].dispatch_ms,
        cut,
        profiles[0].decode_context,
        tuple(p.decode_kv_ms for p in profiles),
    )
    return CostTable(name, tuple(tokens), tuple(times), over)
