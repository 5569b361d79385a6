"""vLLM's /tokenize and /detokenize: request models and answers, shared by every front end.

Shapes as vLLM serves them: /tokenize takes a `prompt` (special tokens added by default) or chat
`messages` (rendered with the chat template, special tokens not added on top: the template writes
them) and answers `{count, max_model_len, tokens, token_strs}`; /detokenize takes `tokens` and answers
`{prompt}`. Fields vLLM has that pdserve does not implement (a per-request chat template, multimodal
kwargs) are refused with a 400, not ignored.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.errors import BadRequest
from pdserve.openai_api.protocol import ChatMessage, TextBody


class TokenizeRequest(TextBody):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    """Default True for a prompt, False for messages (vLLM's defaults)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict] | None = None
    """Passed to the chat template (which may describe them in the prompt)."""

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(tokenizer: Tokenizer, req: TokenizeRequest, max_model_len: int) -> dict:
    """The /tokenize answer; BadRequest when the chat template refuses the conversation."""
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, req.add_generation_prompt, tools=req.tools)
        except ValueError as e:
            raise BadRequest(f"cannot apply the chat template: {e}", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        assert req.prompt is not None
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=add)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: Tokenizer, req: DetokenizeRequest) -> dict:
    """The /detokenize answer; BadRequest for an id outside the vocabulary."""
    vocab = tokenizer.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
