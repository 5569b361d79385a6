"""The one prompt validation, shared by every boundary that accepts a prompt.

The router (and `pdserve batch`, which reuses the router's request handling) answers a
`PromptError` with an OpenAI-shaped 400 naming `param`; the nodes let it reach the gRPC error
interceptor as a ValueError (INVALID_ARGUMENT); the engine raises it from `add_request`. Each
boundary checks against the limits it knows (the router: the cluster's context; a node or engine:
its own max_model_len), so a request refused anywhere is refused with the same words.

Torch-free: the router imports it.
"""

from __future__ import annotations

from typing import Sequence

EMPTY_PROMPT = "prompt is empty"


class PromptError(ValueError):
    """A request no engine can run, rejected at the boundary; `param` names the offending request field."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def check_prompt(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, max_prompt_tokens: int | None = None
) -> list[int]:
    """The prompt as a list, if it is non-empty, every id is an int in [0, vocab_size), it is
    within `max_prompt_tokens` (a server's own cap, when set) and it leaves room in max_model_len
    for at least one generated token; else PromptError."""
    ids = list(token_ids)
    if not ids:
        raise PromptError(EMPTY_PROMPT)
    for t in ids:
        if not isinstance(t, int) or t < 0 or t >= vocab_size:
            raise PromptError(f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise PromptError(f"prompt has {len(ids)} tokens; this server accepts at most {max_prompt_tokens}")
    if len(ids) >= max_model_len:
        raise PromptError(
            f"prompt has {len(ids)} tokens, more than this model's context of {max_model_len} "
            f"(max_model_len: the prompt plus at least one generated token must fit)"
        )
    return ids


def check_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """PromptError (param max_tokens) when the prompt plus max_tokens cannot fit in max_model_len."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptError(
            f"this model's maximum context length is {max_model_len} tokens (max_model_len); "
            f"the prompt has {num_prompt_tokens} and max_tokens is {max_tokens}",
            "max_tokens",
        )
