"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.grammar import GrammarSpec, check_spec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
"""Most logit_bias entries per request (OpenAI's limit)."""
MAX_BIAS = 100.0
"""A bias is in [-MAX_BIAS, MAX_BIAS] (OpenAI's range: -100 bans a token, 100 forces it)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping options (vLLM/OpenAI semantics).

    Bad values raise ValueError naming the parameter, so servers can map them
    to a 400 / INVALID_ARGUMENT.
    """

    n: int = 1
    """Number of completions for the prompt (offline API only; servers fan out)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens exist."""
    temperature: float = 1.0
    """0 is greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability."""
    seed: int | None = None
    """Seed of this request's own random generator (reproducible sampling)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """HF-style: divides positive logits (multiplies negative) of seen tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings; the match is cut from the text unless include_stop_str_in_output."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k: the sampled token's logprob plus the top k (k <= 20)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (OpenAI logit_bias), sorted by id."""
    structured_outputs: GrammarSpec | None = None
    """The grammar the output must match (pdserve.engine.grammar); the engine ends the request ("stop") when
    the grammar is complete, whatever min_tokens and ignore_eos say. None: free text."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.structured_outputs is not None:
            spec = GrammarSpec(*self.structured_outputs)
            object.__setattr__(self, "structured_outputs", spec)
            try:
                check_spec(spec)
            except ValueError as e:
                raise ValueError(f"invalid sampling parameter structured_outputs: {e}") from None
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be >= 1, got {self.max_tokens}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be >= 0, got {self.min_tokens}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 or positive, got {self.top_k}"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
        )
        _check(
            all(t >= 0 and -MAX_BIAS <= b <= MAX_BIAS for t, b in self.logit_bias),
            "logit_bias",
            f"token ids must be >= 0 and biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_sampler_state(self) -> bool:
        """The sampler needs this request's own state: a generator, its history or its grammar."""
        return not self.greedy or self.has_penalties or self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        """Anything that changes the logits before sampling: penalties or a logit bias."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: {message}")
