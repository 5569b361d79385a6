"""The engine's data model: a Request, its status, and what a step reports about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.engine.block_keys import BlockKey
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import StopStringChecker


class AdmissionError(Exception):
    """The request cannot be admitted now (no KV room under a never-preempt policy)."""


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is a finished state."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    """Decode node: blocks allocated, a prefill node is filling them."""
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class TokenLogprob(NamedTuple):
    """Logprob of a sampled token and the top alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Request:
    """One sequence in the engine. `num_computed_tokens` counts tokens whose KV is in the pool.

    Compared by identity (eq=False): the scheduler's `in` and `remove` on its queues compared every
    field, token lists included, ~1% of a bf16 engine run with 128 running requests."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Effective output budget (params.max_tokens capped by the context)."""
    prefill_only: bool = False
    """Prefill node: finish after the first token and keep the blocks pinned until `release` (a
    KV transfer still reads them); vLLM's `do_remote_decode`."""
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    """What the engine's KV connector reads about this request (e.g. `do_remote_prefill`)."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    queue_seconds: float | None = None
    """Seconds from arrival until the request first ran (decode nodes: until its remote KV landed)."""
    stop_checker: StopStringChecker | None = None
    """StopStringChecker when the request has stop strings (engine.stop_strings)."""
    num_emitted: int = 0
    """Output tokens already reported by step() (for deltas)."""
    matcher: Any = None
    """xgrammar GrammarMatcher of a structured-output request (engine.grammar_cache): it masks the
    logits and advances with every token sampled."""
    kv_root: BlockKey = 0
    """Root of the request's block-key chain: the engine's KV compatibility and the request's
    cache_salt (engine.kv_namespace.request_root), so tenants never share cached blocks."""

    def start_running(self) -> None:
        """Waiting (for a slot or for remote KV) -> RUNNING; the first time also fixes queue_seconds."""
        self.status = RequestStatus.RUNNING
        if self.queue_seconds is None:
            self.queue_seconds = time.monotonic() - self.arrival_time

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class StepOutput(NamedTuple):
    """What one step produced for one request: a delta, plus totals."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    queue_seconds: float | None = None
    """Seconds the request waited before it first ran (None until it has run)."""


@dataclass
class CompletionOutput:
    """One generated sequence of an offline request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    """Result of LLM.generate for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
