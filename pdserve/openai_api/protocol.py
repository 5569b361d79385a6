"""OpenAI request bodies (the subset pdserve serves), validated with pydantic.

Out-of-range values are pydantic validation errors, which the app turns into
400s in the OpenAI error shape (never 422)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.engine.sampling_params import MAX_BIAS, MAX_LOGIT_BIAS

MAX_N = 16
MAX_STOP = 16
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_CACHE_SALT_BYTES = 256
"""Bounds of the proto fields these values travel in (common.proto): larger values are 400s here,
never an overflow when the request is built."""

MAX_STOP_TOKEN_IDS = 64
"""As many as a node accepts (pdserve.node_runtime.convert)."""

StopField = Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. continuous_usage_stats: refused, not ignored

    include_usage: bool = False


class TextBody(BaseModel):
    """A request body whose strings reach the tokenizer: a lone UTF-16 surrogate is refused."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        """JSON can spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or proto string accepts."""
        _check_utf8(data)
        return data


class SamplingFields(TextBody):
    """Fields shared by completions and chat completions. Other fields are kept in `model_extra`
    and refused with a 400 unless they ask for nothing (openai_api.request_fields)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    # vLLM-style extensions, accepted by clients of the anchor systems
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    stop_token_ids: Annotated[
        list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(max_length=MAX_STOP_TOKEN_IDS)
    ] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]], Field(max_length=MAX_LOGIT_BIAS)]
        | None
    ) = None
    """OpenAI: token id (as a string) -> bias added to its logit; ids are checked against the vocabulary."""
    cache_salt: Annotated[str, Field(min_length=1, strict=True)] | None = None
    """vLLM's field: prefix-cache hits only among requests with the same salt (tenant isolation)."""
    # structured output, in OpenAI's and vLLM's spellings (at most one set; openai_api.structured)
    response_format: dict[str, Any] | None = None
    """OpenAI: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {name, schema, strict}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM: exactly one of {json, regex, choice, grammar, json_object}."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_is_bounded(cls, value: str | None) -> str | None:
        if value is not None and len(value.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes of UTF-8")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class CompletionRequest(SamplingFields):
    """POST /v1/completions"""

    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    return_token_ids: bool = False
    """vLLM's field: each choice also carries the prompt's and the generated token ids, so a client
    can append exactly the tokens the model produced (re-encoding the text may give other ids)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by openai_api.request_fields (tool_calls: refused)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None
    name: str | None = None

    @model_validator(mode="after")
    def _text_parts_are_strings(self):
        for part in self.content if isinstance(self.content, list) else []:
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError("a content part of type 'text' needs a string 'text'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions"""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


def _check_utf8(value) -> None:
    """Raise ValueError if any string in a JSON value cannot be encoded as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text contains a lone UTF-16 surrogate, which is not valid Unicode") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            if not isinstance(v, int):  # token-id prompts: skip the common case cheaply
                _check_utf8(v)
