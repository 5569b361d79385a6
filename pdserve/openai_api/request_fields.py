"""Request fields pdserve knows but does not implement: each is refused with a 400 naming it,
unless its value asks for nothing (a default, null, or empty). Unknown fields are refused too.

A client that sends `tools`, `best_of` or a misspelt `max_token` must learn that nothing
was applied, not get a 200 that silently ignored it. The request-field table (docs/request-fields.md) lists
what is honoured and what is refused, and tests/router/test_request_fields.py checks every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from pdserve.openai_api.errors import BadRequest

BOTH, COMPLETIONS, CHAT = frozenset({"completions", "chat"}), frozenset({"completions"}), frozenset({"chat"})


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _one_of(*noops: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in noops)


@dataclass(frozen=True)
class Refused:
    """A known field pdserve does not implement, and why."""

    why: str
    asks_nothing: Callable[[Any], bool] = _empty
    """Values that request nothing pdserve lacks: accepted (e.g. tool_choice "none")."""
    endpoints: frozenset[str] = BOTH


_GUIDED = "structured outputs are set by response_format, structured_outputs or guided_json/regex/choice/grammar"
REFUSED: dict[str, Refused] = {
    "guided_decoding_backend": Refused("the grammar engine is always xgrammar", _one_of("xgrammar", "auto")),
    "guided_whitespace_pattern": Refused(f"JSON is generated without free whitespace; {_GUIDED}"),
    "structural_tag": Refused(f"structural tags are not implemented; {_GUIDED}"),
    "tools": Refused("tool calling is not implemented", endpoints=CHAT),
    "tool_choice": Refused("tool calling is not implemented", _one_of("none"), CHAT),
    "functions": Refused("function calling is not implemented", endpoints=CHAT),
    "function_call": Refused("function calling is not implemented", _one_of("none"), CHAT),
    "best_of": Refused("best_of > 1 (server-side candidates) is not implemented", _one_of(1)),
    "use_beam_search": Refused("beam search is not implemented", _one_of(False)),
    "length_penalty": Refused("length_penalty only applies to beam search", _one_of(1.0, 1)),
    "prompt_logprobs": Refused("prompt logprobs are not computed (a prefill node returns only the first token)"),
    "echo": Refused("chat echo is not implemented (completions echo is)", _one_of(False), CHAT),
    "suffix": Refused("fill-in-the-middle (suffix) is not implemented", endpoints=COMPLETIONS),
    "chat_template": Refused("the model's own chat template is used; a per-request template is not", endpoints=CHAT),
    "chat_template_kwargs": Refused("per-request chat template arguments are not implemented", endpoints=CHAT),
    "documents": Refused("RAG documents in the chat template are not implemented", endpoints=CHAT),
    "add_generation_prompt": Refused("the generation prompt is always added", _one_of(True), CHAT),
    "continue_final_message": Refused("continuing the final message is not implemented", _one_of(False), CHAT),
    "add_special_tokens": Refused("the tokenizer's default special tokens are always used", _one_of(False), CHAT),
    "priority": Refused("priority scheduling is not implemented", _one_of(0)),
    "logits_processors": Refused("custom logits processors are not loaded by this server"),
    "allowed_token_ids": Refused("allowed_token_ids is not implemented (logit_bias is)"),
    "bad_words": Refused("bad_words is not implemented (logit_bias is)"),
    "truncate_prompt_tokens": Refused("prompts are never truncated: a long one is refused with a 400"),
    "spaces_between_special_tokens": Refused("special tokens are decoded by the tokenizer's rules", _one_of(True)),
    "return_token_ids": Refused("token ids are returned by completions only", _one_of(False), CHAT),
    "return_tokens_as_token_ids": Refused("logprob tokens are always returned as text", _one_of(False)),
    "mm_processor_kwargs": Refused("multimodal input is not supported"),
    "kv_transfer_params": Refused("KV transfer is the cluster's own business, not a request's"),
    "vllm_xargs": Refused("no custom extensions are loaded"),
    "request_id": Refused("pdserve assigns its own request ids"),
    "reasoning_effort": Refused("reasoning controls are not implemented"),
    "include_reasoning": Refused("reasoning output is not separated", _one_of(True)),
    "store": Refused("completions are not stored", _one_of(False)),
    "metadata": Refused("completions are not stored, so there is nothing to attach metadata to"),
    "service_tier": Refused("there is one service tier", _one_of("auto", "default")),
    "modalities": Refused("only text output is supported", lambda v: _empty(v) or v == ["text"]),
    "audio": Refused("audio output is not supported", endpoints=CHAT),
    "prediction": Refused("predicted outputs are not implemented", endpoints=CHAT),
    "web_search_options": Refused("web search is not implemented", endpoints=CHAT),
}
MESSAGE_REFUSED: dict[str, Refused] = {
    "tool_calls": Refused("assistant tool calls are not implemented"),
    "function_call": Refused("function calling is not implemented"),
    "audio": Refused("audio messages are not supported"),
}
MESSAGE_ACCEPTED = frozenset({"tool_call_id", "refusal", "reasoning_content"})
"""Message keys the chat template may use or that carry no instruction (an assistant's refusal text)."""


def check_request_fields(req: BaseModel, endpoint: str) -> None:
    """BadRequest (400, `param` = the field) for any field the request sets that pdserve does not
    implement, or does not know at all."""
    for name, value in (req.model_extra or {}).items():
        _check_one(name, value, REFUSED, endpoint, name)
    for i, message in enumerate(getattr(req, "messages", None) or []):
        for name, value in (message.model_extra or {}).items():
            if name not in MESSAGE_ACCEPTED:
                _check_one(name, value, MESSAGE_REFUSED, "chat", f"messages[{i}].{name}")
        for part in message.content if isinstance(message.content, list) else []:
            if part.get("type") != "text":
                raise BadRequest(
                    f"messages[{i}].content: content parts of type {part.get('type')!r} are not supported "
                    "(only 'text'; this server serves a text-only model)",
                    f"messages[{i}].content",
                )


def _check_one(name: str, value: Any, table: dict[str, Refused], endpoint: str, param: str) -> None:
    rule = table.get(name)
    if rule is None or endpoint not in rule.endpoints:
        raise BadRequest(f"unknown field {param!r} (see docs/request-fields.md)", param)
    if not rule.asks_nothing(value):
        raise BadRequest(f"{param} is not supported: {rule.why}", param)
