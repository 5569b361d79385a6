"""OpenAI Batch files for the offline pipeline: parse input lines, shape output lines.

Validation and tokenization reuse the router's request models and `Server.*_choices`
(one parser for HTTP and batch); the response body has the HTTP API's non-streaming shape.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from engine.tokenizer import Tokenizer
from router.errors import RouterError
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.serving import Choice, Server

URLS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


class LineError(ValueError):
    """One input line cannot run; becomes an error line, the job goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _NoCluster:
    """Server needs a cluster only for the context length; the batch job has its own model."""

    def __init__(self, max_model_len: int) -> None:
        self._len = max_model_len

    def max_model_len(self) -> int:
        return self._len


@dataclass
class BatchItem:
    """A validated line: its ids, the router choice (prompt, params, text assembly) and the body."""

    custom_id: str
    url: str
    body: CompletionRequest | ChatCompletionRequest
    choice: Choice


def make_server(tokenizer: Tokenizer, model_name: str, max_model_len: int) -> Server:
    return Server(_NoCluster(max_model_len), tokenizer, model_name, max_model_len)  # type: ignore[arg-type]


def _check_greedy(body: CompletionRequest | ChatCompletionRequest) -> None:
    """The pipeline runtime samples greedily only: refuse what it would silently ignore."""
    if body.temperature is None or body.temperature > 0:
        raise LineError("unsupported_sampling", "the offline pipeline is greedy-only: set \"temperature\": 0")
    unsupported = [name for name, off in [("top_p", body.top_p in (None, 1.0)), ("top_k", body.top_k in (None, -1, 0)),
                                          ("min_p", not body.min_p), ("presence_penalty", not body.presence_penalty),
                                          ("frequency_penalty", not body.frequency_penalty),
                                          ("repetition_penalty", body.repetition_penalty in (None, 1.0)),
                                          ("min_tokens", not body.min_tokens), ("n", body.n == 1),
                                          ("stream", not body.stream), ("logprobs", not body.logprobs)] if not off]
    if isinstance(body, CompletionRequest) and body.suffix:
        unsupported.append("suffix")
    if unsupported:
        raise LineError("unsupported_sampling", f"the offline pipeline does not support: {', '.join(unsupported)}")


def parse_line(line: str, server: Server) -> BatchItem:
    """Validate one input line; LineError (with the custom_id when known) otherwise."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise LineError("invalid_json", f"line is not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise LineError("invalid_request", "line needs a non-empty string custom_id")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_request", f"method must be POST, not {obj.get('method')!r}")
    model = URLS.get(obj.get("url"))
    if model is None:
        raise LineError("invalid_url", f"url must be one of {sorted(URLS)}, not {obj.get('url')!r}")
    try:
        body = model.model_validate({"model": server.model_name, **(obj.get("body") or {})})
    except (ValidationError, TypeError) as e:
        raise LineError("invalid_body", f"invalid body: {e}") from None
    _check_greedy(body)
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and len(body.prompt) != 1 \
            and not isinstance(body.prompt[0], int):
        raise LineError("invalid_body", "one prompt per line (a list of prompts is not supported in batch mode)")
    try:
        choices = server.chat_choices(body) if isinstance(body, ChatCompletionRequest) else \
            server.completion_choices(body)
    except RouterError as e:
        raise LineError("invalid_body", str(e)) from None
    return BatchItem(obj["custom_id"], obj["url"], body, choices[0])


def custom_id_of(line: str) -> str | None:
    """The custom_id of a line if it has one, to label error lines."""
    try:
        obj = json.loads(line)
        return obj.get("custom_id") if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) else None
    except ValueError:
        return None


def result_line(item: BatchItem, output_ids: list[int], finish_reason: str, tokenizer: Tokenizer,
                model_name: str) -> dict:
    """The output line of a finished request, body shaped like the HTTP non-streaming answer."""
    c = item.choice
    text = c.text.add(output_ids) + c.text.finish()
    if c.text.stopped:
        finish_reason = "stop"
    else:  # all tokens are here at once: decode them whole, as engine.LLM does (keeps a trailing partial char)
        text = tokenizer.decode(output_ids)
    prompt, completion = len(c.prompt_ids), len(output_ids)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": 0}}
    created = int(time.time())
    if isinstance(item.body, ChatCompletionRequest):
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                "model": model_name, "usage": usage, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}]}
    else:
        prefix = (c.prompt_text or tokenizer.decode(c.prompt_ids)) if item.body.echo else ""
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
                "model": model_name, "usage": usage, "choices": [
                    {"index": 0, "text": prefix + text, "logprobs": None, "finish_reason": finish_reason}]}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "error": None,
            "response": {"status_code": 200, "request_id": body["id"], "body": body}}


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
