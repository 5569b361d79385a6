"""The non-streamed OpenAI response bodies, shaped once for the router and the batch job."""

from __future__ import annotations

import time
import uuid


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """The `usage` object of a response; None `cached_tokens` leaves out prompt_tokens_details
    (`--no-enable-prompt-tokens-details`, vLLM's default shape)."""
    body: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def new_response_id(chat: bool) -> str:
    """A fresh response id, `chatcmpl-<hex>` or `cmpl-<hex>` (OpenAI's prefixes)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def response_body(chat: bool, model: str, choices: list[dict], usage_obj: dict, response_id: str | None = None) -> dict:
    """A chat.completion or text_completion object around its per-choice dicts, with `response_id`
    (a fresh one if None)."""
    obj = "chat.completion" if chat else "text_completion"
    return {
        "id": response_id or new_response_id(chat),
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_obj,
    }


def completion_choice(
    index: int,
    text: str,
    logprobs: dict | None,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """One choice of a text_completion (or of a chunk); the id lists only when asked for
    (`return_token_ids`: vLLM sends the prompt's ids once, the generated ids as deltas)."""
    body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def chat_delta(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    """One choice of a streamed chat.completion.chunk."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
