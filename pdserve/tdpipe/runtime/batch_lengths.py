"""How long each batch line may run and how long the planner expects it to run.

A chat line without `max_tokens` may run to the end of the context, which on a 32k-context model
is far more than the pipeline's KV holds. Two separate answers:

- **What fits** (`fit_line`): a line whose prompt + max_tokens exceeds the KV one request can hold
  is refused only when it names that max_tokens; a defaulted one runs up to the KV instead, as the
  serving engine lowers its max_model_len to what its pool holds (`engine.kv_sizing`), so `usage`
  matches the HTTP API on the same pool. A prompt that leaves no room at all is refused.
- **What the planner expects** (`LengthPlanner`): TD-Pipe admits requests on their predicted
  output length (recompute-preempting when a prediction was short), not on max_tokens, which for
  a defaulted line is the whole context and would admit one request at a time. The prediction is
  `--length-predictor PATH` (a `tdpipe.train_predictor` model) when given, else a heuristic from
  the workload: lines that name max_tokens plan on it, the others on the median of the last
  `STATED_WINDOW` stated ones seen so far (the input is streamed, so the job's own idea of an
  answer's length builds up as lines are read), or `DEFAULT_PREDICTED_LEN` before any line names one.
"""

from __future__ import annotations

import statistics
from collections import deque

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.protocol import ChatCompletionRequest
from pdserve.tdpipe.predictor import BucketPredictor
from pdserve.tdpipe.runtime.batch_config import DEFAULT_PREDICTED_LEN
from pdserve.tdpipe.runtime.batch_io import BatchItem, LineError

STATED_WINDOW = 1024
"""How many of the latest stated max_tokens the heuristic's median is taken over (bounded memory)."""


def fills_context(item: BatchItem) -> bool:
    """A chat line without max_tokens / max_completion_tokens: it may run to the end of the context."""
    body = item.body
    return isinstance(body, ChatCompletionRequest) and not (body.max_completion_tokens or body.max_tokens)


def fit_line(item: BatchItem, capacity: int, where: str = "") -> None:
    """Make `item` fit `capacity` KV tokens (module docstring), or LineError `prompt_too_long`.
    `where` qualifies the capacity in the message (" per virtual engine")."""
    request = item.choice.request
    prompt, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
    if prompt + max_tokens <= capacity:
        return
    if fills_context(item) and prompt < capacity:
        request.params.max_tokens = capacity - prompt  # the proto params the stages and usage read
        return
    raise LineError(
        "prompt_too_long",
        f"prompt + max_tokens is {prompt + max_tokens} tokens; the pipeline's KV holds {capacity}{where} "
        f"(raise --kv-cache-memory, --num-kv-blocks or --block-size)",
        status=400,
        param="max_tokens",
    )


class LengthPlanner:
    """Predicted output lengths of a job's lines (module docstring); `path`: a saved BucketPredictor
    (ValueError when it cannot be loaded)."""

    def __init__(self, path: str | None = None) -> None:
        self.model = BucketPredictor.load(path) if path else None
        self.source = f"predictor {path}" if path else "workload heuristic"
        self.stated: deque[int] = deque(maxlen=STATED_WINDOW)

    def predict(self, items: list[BatchItem], tokenizer: Tokenizer) -> list[int]:
        caps = [it.choice.request.params.max_tokens for it in items]
        if self.model is not None:
            texts = [it.choice.prompt_as_text(tokenizer) for it in items]
            return [max(1, min(cap, p)) for cap, p in zip(caps, self.model.predict(texts))]
        self.stated.extend(cap for it, cap in zip(items, caps) if not fills_context(it))
        guess = round(statistics.median(self.stated)) if self.stated else DEFAULT_PREDICTED_LEN
        return [max(1, min(cap, guess)) if fills_context(it) else cap for it, cap in zip(items, caps)]
