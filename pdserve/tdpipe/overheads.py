"""What a real pipeline spends besides the stages' forward passes, as fitted cost terms.

The cost table prices a forward pass; a real pipeline (`tdpipe.runtime`) also pays, per batch:

- the hand-off: stage k's hidden states travel to stage k + 1 (a gloo send of tokens x hidden),
  between the end of stage k's span and the start of stage k + 1's;
- the dispatch: the last stage's tokens travel to the controller, the controller applies them,
  plans the next batch and sends its control message to the first stage. A batch that depends
  on a returned one cannot start before that round trip;
- unequal stages: the last stage also runs the LM head, so the other stages idle a share of
  every step even in a full pipeline;
- the KV a decode step reads: the table prices a step of n sequences at the profile's one KV
  length, but every sequence reads its own KV, so a step over long prompts (a phase's last steps,
  where the long outputs remain) costs more and one over short ones less. Per stage, a slope in
  ms per KV token away from that length corrects it (`PipelineOverheads.decode_kv_ms`).

The runtime's profile pass measures them (`pdserve.tdpipe.runtime.profile_comm`) and the simulator's
pipeline (`tdpipe.pipeline.Pipeline`) charges them, so that it predicts the measured bubble.
Zero overheads (the default) are the ideal pipeline of the paper's simulator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearCost:
    """`base_ms + per_token_ms * n` for a batch of `n` tokens (both >= 0)."""

    base_ms: float = 0.0
    per_token_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.per_token_ms < 0:
            raise ValueError(f"costs must be >= 0, got {self.base_ms} + {self.per_token_ms}/token")

    def __call__(self, num_tokens: int) -> float:
        return self.base_ms + self.per_token_ms * max(0, num_tokens)

    @classmethod
    def fit(cls, points: dict[int, float]) -> "LinearCost":
        """Least-squares line through (tokens, ms) points, clamped to non-negative terms (a
        noisy negative slope becomes a constant at the mean)."""
        if not points:
            raise ValueError("need at least one point to fit")
        xs, ys = list(points), list(points.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        if slope <= 0:
            return cls(max(0.0, my), 0.0)
        base = my - slope * mx
        if base < 0:  # refit through the origin
            slope = sum(x * y for x, y in zip(xs, ys)) / max(1e-12, sum(x * x for x in xs))
            return cls(0.0, max(0.0, slope))
        return cls(base, slope)


@dataclass(frozen=True)
class PipelineOverheads:
    """The fitted non-forward costs of one pipeline (module docstring); all zero by default."""

    handoff: LinearCost = LinearCost()
    """Hidden states from one stage to the next, by the batch's tokens."""
    dispatch: LinearCost = LinearCost()
    """Last stage -> controller -> first stage, by the batch's tokens."""
    decode_shares: tuple[float, ...] = ()
    """Per stage, its decode step time over the slowest stage's (1.0 for the slowest); () = equal."""
    prefill_shares: tuple[float, ...] = ()
    """The same for prefill batches."""
    decode_context: int = 0
    """The KV length per sequence the table's decode steps were measured at."""
    decode_kv_ms: tuple[float, ...] = ()
    """Per stage, a decode step's extra ms per KV token its sequences read beyond `decode_context`
    each (fewer: less); () = the table's time whatever the KV length."""

    def __post_init__(self) -> None:
        for shares in (self.decode_shares, self.prefill_shares):
            if any(not 0.0 < s <= 1.0 for s in shares):
                raise ValueError(f"stage shares must be in (0, 1], got {shares}")
        if self.decode_context < 0 or any(k < 0 for k in self.decode_kv_ms):
            raise ValueError(f"KV costs must be >= 0, got {self.decode_context}, {self.decode_kv_ms}")

    def decode_kv_extra(self, num_stages: int, num_seqs: int, kv_tokens: int) -> tuple[float, ...]:
        """Per stage, the ms a decode step of `num_seqs` sequences reading `kv_tokens` KV tokens in
        all takes beyond (or, negative, under) the table's step at `decode_context` per sequence."""
        if len(self.decode_kv_ms) != num_stages:
            return (0.0,) * num_stages
        excess = kv_tokens - num_seqs * self.decode_context
        return tuple(k * excess for k in self.decode_kv_ms)

    def shares(self, num_stages: int, decode: bool) -> tuple[float, ...]:
        """Each stage's time as a fraction of the slowest stage's, for a decode or prefill batch."""
        shares = self.decode_shares if decode else self.prefill_shares
        return shares if len(shares) == num_stages else (1.0,) * num_stages

    @property
    def is_zero(self) -> bool:
        return self == PipelineOverheads()

    def to_dict(self) -> dict:
        return {
            "handoff_ms": [self.handoff.base_ms, self.handoff.per_token_ms],
            "dispatch_ms": [self.dispatch.base_ms, self.dispatch.per_token_ms],
            "decode_shares": list(self.decode_shares),
            "prefill_shares": list(self.prefill_shares),
            "decode_context": self.decode_context,
            "decode_kv_ms": list(self.decode_kv_ms),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "PipelineOverheads":
        return cls(
            LinearCost(*map(float, data["handoff_ms"])),
            LinearCost(*map(float, data["dispatch_ms"])),
            tuple(map(float, data.get("decode_shares", ()))),
            tuple(map(float, data.get("prefill_shares", ()))),
            int(data.get("decode_context", 0)),
            tuple(map(float, data.get("decode_kv_ms", ()))),
        )
