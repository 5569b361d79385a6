"""OpenAI request bodies -> choices: validated, tokenized, each with the wire request that runs it.

The router and the batch job build their choices here, so one body gets the same 400 (or the same
parameters) from both front ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from pdserve.engine.prompt_check import EMPTY_PROMPT, PromptError, check_max_tokens, check_prompt
from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.errors import BadRequest
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.openai_api.request_fields import check_request_fields
from pdserve.openai_api.structured import structured_outputs_of
from pdserve.openai_api.text import ChoiceText
from pdserve.v1 import common_pb2, decode_pb2

SHARED_SAMPLING_FIELDS = tuple(
    sorted(
        {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
        & set(SamplingFields.model_fields)
        - {"max_tokens", "stop", "stop_token_ids", "logit_bias", "structured_outputs"}
    )
)
"""OpenAI request fields that travel unchanged in the proto field of the same name (and meaning);
max_tokens and stop are checked and resolved first, logprobs differs between the two endpoints, and
the list, map and structured-output fields are converted on their own (`_params`)."""


@dataclass
class Choice:
    """One generated sequence: the wire request that runs it, and what has come back so far."""

    index: int
    prompt_index: int
    """Which prompt of the body this choice continues: the n choices of a prompt share it, and usage
    counts each prompt once."""
    request: decode_pb2.GenerateRequest
    """The prompt's token ids, the sampling params and the cache_salt (its block keys' namespace, on
    the router and on the nodes) as the decode node takes them; the router names it (request_id)
    when it runs, and each attempt sends a copy continued after the tokens already sent."""
    prompt_text: str | None
    """The prompt as the body gave it (a completion's string prompt), else None."""
    text: ChoiceText
    logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """The generated token ids so far."""
    finish_reason: str | None = None
    """Why the choice ended, set by its last event (`add`); None until then."""
    usage: common_pb2.Usage | None = None

    def add(self, event: decode_pb2.GenerateEvent) -> str:
        """Take in one event of the choice's stream; the text it adds (cut at stop strings). The last
        event also sets finish_reason (OpenAI has no "abort": it reads "stop") and usage."""
        delta = self.text.add(list(event.token_ids))
        self.logprobs += event.logprobs
        self.token_ids += event.token_ids
        if event.finish_reason:
            delta += self.text.finish()
            self.finish_reason = event.finish_reason if event.finish_reason != "abort" else "stop"
            self.usage = event.usage
        return delta

    def prompt_as_text(self, tokenizer: Tokenizer) -> str:
        """The prompt's text (echo): as the body gave it, else decoded from its token ids."""
        return self.prompt_text or tokenizer.decode(list(self.request.prompt_token_ids))


class ChoiceBuilder:
    """Checks and tokenizes OpenAI bodies against a context length; BadRequest (a 400 naming the
    field) for anything the cluster cannot run."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: Callable[[], int],
        max_prompt_tokens: int | None = None,
        defaults: Mapping[str, float | int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        """The context to check against, asked per request (a router learns it from its nodes)."""
        self.max_prompt_tokens = max_prompt_tokens
        self.defaults = dict(defaults or {})
        """Request field -> value used when a request leaves it unset (the model's generation_config.json,
        engine.generation_defaults); `max_tokens` here replaces the endpoint's own default."""

    def _params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        prompt_len: int,
        logprobs: int | None,
        default_max: int | None,
    ) -> common_pb2.SamplingParams:
        limit = self.max_model_len()  # the prompt fits (_check_ids)
        if max_tokens is None:
            default = self.defaults.get("max_tokens")  # an int in generation_config.json (max_new_tokens)
            max_tokens = min(int(default) if default else (default_max or limit), limit - prompt_len)
        try:
            check_max_tokens(prompt_len, max_tokens, limit)
        except PromptError as e:
            raise BadRequest(str(e), e.param) from None
        try:
            stop = req.stop_list()
        except ValueError as e:
            raise BadRequest(str(e), "stop") from None
        # OpenAI's default temperature is 1; an unset proto3 temperature would mean greedy
        p = common_pb2.SamplingParams(
            temperature=1.0, max_tokens=max_tokens, stop=stop, stop_token_ids=req.stop_token_ids
        )
        for key, bias in (req.logit_bias or {}).items():
            p.logit_bias[self._token_id(key)] = bias
        structured = structured_outputs_of(req)
        if structured is not None:
            p.structured_outputs.CopyFrom(structured)
        for name in SHARED_SAMPLING_FIELDS:
            value = getattr(req, name)
            if value is None:  # unset: the model's default, else the engine's
                value = self.defaults.get(name)
            if value is not None:
                setattr(p, name, value)
        if logprobs is not None:
            p.logprobs = logprobs
        return p

    def _token_id(self, key: str) -> int:
        """A logit_bias key: a token id of this model's vocabulary, written as a string (OpenAI)."""
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < self.tokenizer.vocab_size:
            raise BadRequest(
                f"logit_bias: {key!r} is not a token id of this model (0 to {self.tokenizer.vocab_size - 1})",
                "logit_bias",
            )
        return token

    def _text(self, ids: list[int], params: common_pb2.SamplingParams) -> ChoiceText:
        return ChoiceText(
            self.tokenizer,
            ids,
            list(params.stop),
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        )

    def _choice(
        self,
        index: int,
        prompt_index: int,
        ids: list[int],
        prompt_text: str | None,
        params: common_pb2.SamplingParams,
        cache_salt: str | None,
    ) -> Choice:
        """A choice with its own request (its own copy of the params: the batch job lowers one line's
        max_tokens to what its KV holds)."""
        request = decode_pb2.GenerateRequest(prompt_token_ids=ids, params=params, cache_salt=cache_salt)
        return Choice(index, prompt_index, request, prompt_text, self._text(ids, params))

    def _check_ids(self, ids: list[int]) -> list[int]:
        """The prompt checked as every boundary checks it (engine.prompt_check), against the cluster's
        context and --max-prompt-tokens; a 400 naming the field otherwise."""
        try:
            return check_prompt(ids, self.tokenizer.vocab_size, self.max_model_len(), self.max_prompt_tokens)
        except PromptError as e:
            raise BadRequest(str(e), e.param) from None

    def completion_choices(self, req: CompletionRequest) -> list[Choice]:
        check_request_fields(req, "completions")
        one = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
        prompts: list = [req.prompt] if one else list(req.prompt)
        if not prompts:
            raise BadRequest(EMPTY_PROMPT, "prompt")
        choices: list[Choice] = []
        for prompt_index, p in enumerate(prompts):
            if isinstance(p, str) and not p:
                raise BadRequest(EMPTY_PROMPT, "prompt")
            text = p if isinstance(p, str) else None
            ids = self._check_ids(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
            params = self._params(req, req.max_tokens, len(ids), req.logprobs, default_max=16)
            for _ in range(req.n):
                choices.append(self._choice(len(choices), prompt_index, ids, text, params, req.cache_salt))
        return choices

    def chat_choices(self, req: ChatCompletionRequest) -> list[Choice]:
        check_request_fields(req, "chat")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self._check_ids(self.tokenizer.encode_chat(messages))
        except ValueError as e:
            raise BadRequest(f"cannot apply the chat template: {e}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, len(ids), logprobs, default_max=None)
        return [self._choice(i, 0, ids, None, params, req.cache_salt) for i in range(req.n)]

    def choices(self, req: SamplingFields) -> list[Choice]:
        """The choices of a completion or chat completion body."""
        if isinstance(req, ChatCompletionRequest):
            return self.chat_choices(req)
        assert isinstance(req, CompletionRequest)
        return self.completion_choices(req)
