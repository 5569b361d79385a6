"""OpenAI Batch files for the offline pipeline: parse input lines, shape output lines.

Validation and tokenization are the OpenAI API layer's (openai_api: one parser for HTTP and
batch); the response body has the HTTP API's non-streaming shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.choices import Choice, ChoiceBuilder
from pdserve.openai_api.errors import OpenAIError, error_body, validation_message
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.openai_api.responses import chat_choice, completion_choice, response_body, usage

URLS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


class LineError(ValueError):
    """One input line cannot run; it becomes an error line and the job goes on.

    Two kinds, shaped the way OpenAI's Batch API reports them:

    - `status=None`: the line is not a request at all (not JSON, no custom_id, a method other
      than POST, an unknown url, a repeated custom_id). OpenAI rejects such a file while
      validating it, before any request runs, so no HTTP response exists: the output line has
      `"response": null` and `"error": {"code", "message", "line"}` (`line`, 1-based, as in
      OpenAI's batch validation errors; it also lets `--resume` recognise lines without an id).
    - `status=400`: the request reached the endpoint, which refused its body (invalid fields,
      prompt over the context or the pipeline's KV, sampling the runtime cannot do). OpenAI puts
      such answers in the output as an HTTP response: `"response": {"status_code": 400,
      "request_id", "body": {"error": {message, type, param, code}}}` with `"error": null`; the
      body is what the router's HTTP API returns for the same request.
    """

    def __init__(self, code: str, message: str, *, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


def _bad_body(code: str, message: str, param: str | None = None) -> LineError:
    return LineError(code, message, status=400, param=param)


@dataclass
class BatchItem:
    """A validated line: its ids, the router choice (prompt, params, text assembly) and the body."""

    custom_id: str
    url: str
    body: CompletionRequest | ChatCompletionRequest
    choice: Choice


def _check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse what the pipeline would silently ignore. It samples as the engine does (temperature,
    top-k/p, min-p, penalties, seed: the last stage runs the engine's sampler), but returns one
    choice per line, no logprobs, no token ids and no stream, and has no minimum-length or suffix support."""
    unsupported = [
        name
        for name, off in [
            ("min_tokens", not body.min_tokens),
            ("n", body.n == 1),
            ("stream", not body.stream),
            ("logprobs", not body.logprobs),
            ("return_token_ids", not getattr(body, "return_token_ids", False)),
        ]
        if not off
    ]
    if isinstance(body, CompletionRequest) and (body.model_extra or {}).get("suffix"):
        unsupported.append("suffix")
    if unsupported:
        raise _bad_body(
            "unsupported_parameter", f"the offline pipeline does not support: {', '.join(unsupported)}", unsupported[0]
        )


def load_line(text: str) -> dict:
    """The JSON object of one line; LineError("invalid_json") for anything else. Every failure of
    the parser counts (a 10,000-deep line raises RecursionError, not ValueError): one bad line must
    never end the job."""
    try:
        obj = json.loads(text)
    except Exception as e:
        raise LineError("invalid_json", f"line is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json", "line must be a JSON object with custom_id, method, url and body")
    return obj


def custom_id_in(obj: dict) -> str | None:
    """The line's custom_id when it is a non-empty string (what labels its output line)."""
    cid = obj.get("custom_id")
    return cid if isinstance(cid, str) and cid else None


def parse_request(obj: dict, builder: ChoiceBuilder, model_name: str) -> BatchItem:
    """Validate one line's object (from load_line) as the HTTP API validates a request; LineError
    (see its kinds) otherwise, whatever the validators raise."""
    try:
        return _parse(obj, builder, model_name)
    except LineError:
        raise
    except Exception as e:  # e.g. RecursionError from a deeply nested body: the line's fault, not the job's
        raise _bad_body("invalid_body", f"the body cannot be read: {type(e).__name__}: {str(e)[:200]}") from None


def parse_line(text: str, builder: ChoiceBuilder, model_name: str) -> BatchItem:
    """load_line then parse_request: one line's text to a validated item, LineError otherwise."""
    return parse_request(load_line(text), builder, model_name)


def _parse(obj: dict, builder: ChoiceBuilder, model_name: str) -> BatchItem:
    if custom_id_in(obj) is None:
        raise LineError("missing_custom_id", "line needs a non-empty string custom_id")
    if obj.get("method") != "POST":
        raise LineError("invalid_method", f'method must be "POST", not {obj.get("method")!r}')
    model = URLS.get(str(obj.get("url")))
    if model is None:
        raise LineError("invalid_url", f"url must be one of {', '.join(sorted(URLS))}, not {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _bad_body("invalid_body", f"body must be a JSON object, not {type(body).__name__}")
    if body.get("model") is not None and body["model"] != model_name:
        # the router's answer to the same body (404 model_not_found); omitting `model` is allowed here
        raise LineError(
            "model_not_found",
            f"the model {body['model']!r} does not exist; this job serves {model_name!r}",
            status=404,
            param="model",
        )
    try:
        req = model.model_validate({**body, "model": model_name})
    except ValidationError as e:
        raise _bad_body("invalid_body", *validation_message(e.errors())) from None
    _check_supported(req)
    if (
        isinstance(req, CompletionRequest)
        and isinstance(req.prompt, list)
        and len(req.prompt) > 1
        and not isinstance(req.prompt[0], int)
    ):
        raise _bad_body(
            "invalid_body", "one prompt per line (a list of prompts is not supported in batch mode)", "prompt"
        )
    try:
        choices = builder.choices(req)
    except OpenAIError as e:
        code = e.code or ("context_length_exceeded" if "context" in e.message else "invalid_body")
        raise LineError(code, e.message, status=e.status, param=e.param) from None
    return BatchItem(obj["custom_id"], obj["url"], req, choices[0])


def result_line(
    item: BatchItem, output_ids: list[int], finish_reason: str, tokenizer: Tokenizer, model_name: str
) -> dict:
    """The output line of a finished request, body shaped like the HTTP non-streaming answer."""
    c = item.choice
    text = c.text.add(output_ids) + c.text.finish()
    if c.text.stopped:
        finish_reason = "stop"
    else:  # all tokens are here at once: decode them whole, as engine.LLM does (keeps a trailing partial char)
        text = tokenizer.decode(output_ids)
    counts = usage(len(c.request.prompt_token_ids), len(output_ids), 0)
    if isinstance(item.body, ChatCompletionRequest):
        body = response_body(True, model_name, [chat_choice(0, text, None, finish_reason)], counts)
    else:
        prefix = c.prompt_as_text(tokenizer) if item.body.echo else ""
        body = response_body(False, model_name, [completion_choice(0, prefix + text, None, finish_reason)], counts)
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.custom_id,
        "error": None,
        "response": {"status_code": 200, "request_id": body["id"], "body": body},
    }


def error_line(custom_id: str | None, err: LineError, line_no: int) -> dict:
    """The output line of an input line that cannot run (`line_no` is 1-based); see LineError."""
    if err.status is None:
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": err.code, "message": str(err), "line": line_no},
        }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "error": None,
        "response": {
            "status_code": err.status,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": error_body(str(err), "invalid_request_error", err.param, err.code),
        },
    }


def resume_key(row: dict) -> tuple[str, object] | None:
    """What an output line answers, for `--resume`: ("id", custom_id), or ("line", n) for an
    error line without a usable custom_id or about a repeated one (its id belongs to another line)."""
    err = row.get("error")
    if isinstance(err, dict) and (row.get("custom_id") is None or err.get("code") == "duplicate_custom_id"):
        return ("line", err.get("line"))
    return ("id", row["custom_id"]) if isinstance(row.get("custom_id"), str) else None
