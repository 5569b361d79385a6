"""Where to profile a job's pipeline stages: batch sizes and KV length from its requests.

`profile.profile_at` times the stages at a `ProfilePlan`'s points; the plan is derived from the
job (its prompt and output lengths, the KV capacity, the stage count, the batch token budget) so
that the table covers every batch the policies can form, and no more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfilePlan:
    """Where to profile the stages for one job, derived from its requests and KV capacity."""

    decode_batches: list[int]
    """Decode batch sizes to time, up to `decode_max`."""
    prefill_tokens: list[int]
    """Prefill sizes (total prompt tokens) to time, up to the batch token budget."""
    decode_context: int
    """KV length of the job's average decode token."""
    prefill_prompt_len: int
    """Prefill batches are timed as whole prompts of this length: the token-weighted mean of the
    job's prompt lengths (sum L^2 / sum L). A prompt token's attention reads the tokens before it,
    so that is the length whose prompts cost what the job's prompts cost per token (the median
    understated it: bench's 64-request job has a median of 186, a weighted mean of 459, and a
    1536-token batch of 459-token prompts takes 7.5% longer than one of 186-token prompts)."""
    decode_max: int
    """A bound on the decode batch the policies form: the table's decode/prefill cut."""


def mean_decode_context(prompt_lens: list[int], output_lens: list[int]) -> int:
    """KV length of the average decode token: the step that yields token g+1 of a request runs
    over input + g tokens, g = 1 .. output - 1 (the first token comes from the prefill)."""
    tokens = sum(o - 1 for o in output_lens)
    total = sum((o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens))
    return max(1, round(total / max(1, tokens)))


def max_decode_batch(prompt_lens: list[int], output_lens: list[int], kv_tokens: int, num_stages: int) -> int:
    """A bound on the decode batch any policy forms: a TD-Pipe batch is 1/num_stages of the resident
    requests, a PP virtual engine holds 1/num_stages of the KV; both are at most what fits of the
    shortest quarter of the requests, spread over the stages (x1.5 for work stealing's imbalance)."""
    sizes = sorted(p + o for p, o in zip(prompt_lens, output_lens))
    short = sizes[len(sizes) // 4]
    resident = min(len(sizes), kv_tokens // max(1, short))
    return max(1, min(len(sizes), math.ceil(1.5 * resident / num_stages)))


def plan_profile(
    prompt_lens: list[int],
    output_lens: list[int],
    *,
    kv_tokens: int,
    num_stages: int,
    max_batch_tokens: int,
    quick: bool = False,
) -> ProfilePlan:
    """Profile points for a job: decode batches in powers of two (and 3 * 2^k) up to the largest
    decode batch the policies can form, prefill sizes in eighths (halves when `quick`) of the
    largest prefill batch the job can form (the batch budget, or all its prompts if fewer)."""
    if not prompt_lens or len(prompt_lens) != len(output_lens):
        raise ValueError("need one output length per prompt, and at least one request")
    top = max_decode_batch(prompt_lens, output_lens, kv_tokens, num_stages)
    decode = {1, top} | {2**k for k in range(1, 3 if quick else 12) if 2**k < top}
    if not quick:
        decode |= {3 * 2**k for k in range(10) if 3 * 2**k < top}
    budget = min(max_batch_tokens, sum(prompt_lens))  # a small job never forms a bigger prefill batch
    step = max(1, budget // (2 if quick else 8))
    prefill = {n for n in range(step, budget + 1, step) if n > top} | {budget}
    return ProfilePlan(
        sorted(decode),
        sorted(prefill),
        mean_decode_context(prompt_lens, output_lens),
        max(1, round(sum(n * n for n in prompt_lens) / max(1, sum(prompt_lens)))),
        top,
    )
