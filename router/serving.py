"""Serving completions and chat completions on top of Cluster.generate."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from prometheus_client import CollectorRegistry

from engine.prompt_check import EMPTY_PROMPT, PromptError, check_max_tokens, check_prompt
from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2
from router.cluster import Cluster
from router.errors import BadRequest, RouterError
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.request_metrics import RequestMetrics
from router.text import ChoiceText, chat_logprob_entry, completion_logprobs

SHARED_SAMPLING_FIELDS = tuple(
    sorted(
        {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
        & set(SamplingFields.model_fields) - {"max_tokens", "stop"}
    )
)
"""OpenAI request fields that travel unchanged in the proto field of the same name (and meaning);
max_tokens and stop are checked and resolved first, logprobs differs between the two endpoints."""
STREAM_QUEUE_CHUNKS = 32
"""Chunks buffered per choice between the node stream and the HTTP response. When a client stops
reading, the queue fills, the node stream is no longer read, and gRPC flow control holds the rest
on the node: router memory per request stays bounded whatever the client does."""


@dataclass
class Choice:
    """One generated sequence: prompt, parameters, and what has come back so far."""

    index: int
    prompt_ids: list[int]
    prompt_text: str | None
    params: common_pb2.SamplingParams
    text: ChoiceText
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None
    cache_salt: str | None = None
    """The request's cache_salt: its block keys' namespace, on the router and on the nodes."""


class Server:
    """Builds engine-level requests from OpenAI bodies and shapes the answers."""

    def __init__(
        self,
        cluster: Cluster,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        max_prompt_tokens: int | None = None,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics or RequestMetrics(CollectorRegistry(), model_name)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens

    @property
    def max_model_len(self) -> int:
        return self.cluster.max_model_len() or self.default_max_model_len

    # --- requests -> choices --------------------------------------------------------------
    def _params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        prompt_len: int,
        logprobs: int | None,
        default_max: int | None,
    ) -> common_pb2.SamplingParams:
        limit = self.max_model_len  # the prompt fits (_check_ids)
        if max_tokens is None:
            max_tokens = min(default_max or limit, limit - prompt_len)
        try:
            check_max_tokens(prompt_len, max_tokens, limit)
        except PromptError as e:
            raise BadRequest(str(e), e.param) from None
        try:
            stop = req.stop_list()
        except ValueError as e:
            raise BadRequest(str(e), "stop") from None
        # OpenAI's default temperature is 1; an unset proto3 temperature would mean greedy
        p = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, stop=stop)
        for name in SHARED_SAMPLING_FIELDS:
            value = getattr(req, name)
            if value is not None:  # unset: the engine's default
                setattr(p, name, value)
        if logprobs is not None:
            p.logprobs = logprobs
        return p

    def _check_ids(self, ids: list[int]) -> list[int]:
        """The prompt checked as every boundary checks it (engine.prompt_check), against the cluster's
        context and --max-prompt-tokens; a 400 naming the field otherwise."""
        try:
            return check_prompt(ids, self.tokenizer.vocab_size, self.max_model_len, self.max_prompt_tokens)
        except PromptError as e:
            raise BadRequest(str(e), e.param) from None

    def completion_choices(self, req: CompletionRequest) -> list[Choice]:
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise BadRequest(EMPTY_PROMPT, "prompt")
        choices = []
        for p in prompts:
            if isinstance(p, str) and not p:
                raise BadRequest(EMPTY_PROMPT, "prompt")
            text = p if isinstance(p, str) else None
            ids = self._check_ids(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
            params = self._params(req, req.max_tokens, len(ids), req.logprobs, default_max=16)
            for _ in range(req.n):
                choices.append(
                    Choice(
                        len(choices),
                        ids,
                        text,
                        params,
                        ChoiceText(self.tokenizer, ids, list(params.stop)),
                        cache_salt=req.cache_salt,
                    )
                )
        return choices

    def chat_choices(self, req: ChatCompletionRequest) -> list[Choice]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self._check_ids(self.tokenizer.encode_chat(messages))
        except ValueError as e:
            raise BadRequest(f"cannot apply the chat template: {e}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, len(ids), logprobs, default_max=None)
        return [
            Choice(i, ids, None, params, ChoiceText(self.tokenizer, ids, list(params.stop)), cache_salt=req.cache_salt)
            for i in range(req.n)
        ]

    async def choices(self, req: SamplingFields, chat: bool) -> list[Choice]:
        """Validate and tokenize in a worker thread: a multi-megabyte prompt must not stall every other
        stream on the event loop (Tokenizer.encode releases the GIL on long texts)."""
        return await asyncio.to_thread(self.chat_choices if chat else self.completion_choices, req)

    # --- running ------------------------------------------------------------------------
    async def run(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, str, list]]:
        """Run all choices concurrently; yield (choice, text delta, new logprobs) as tokens arrive."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE_CHUNKS * len(choices))
        base = f"cmpl-{uuid.uuid4().hex[:16]}"

        async def one(choice: Choice) -> None:
            try:
                chunks = self.cluster.generate(
                    f"{base}-{choice.index}", choice.prompt_ids, choice.params, cache_salt=choice.cache_salt
                )
                async for chunk in self.metrics.track(chunks):
                    delta = choice.text.add(chunk.token_ids)
                    new_lps = chunk.logprobs or []
                    choice.logprobs += new_lps
                    if chunk.finish_reason:
                        delta += choice.text.finish()
                        choice.finish_reason = chunk.finish_reason if chunk.finish_reason != "abort" else "stop"
                        choice.usage = chunk.usage
                    await queue.put((choice, delta, new_lps))
                await queue.put((choice, None, None))
            except Exception as e:  # delivered to the consumer, which owns the response
                await queue.put((choice, e, None))

        tasks = [asyncio.create_task(one(c)) for c in choices]
        pending = len(choices)
        try:
            while pending:
                choice, delta, lps = await queue.get()
                if delta is None:
                    pending -= 1
                elif isinstance(delta, Exception):
                    raise delta
                else:
                    yield choice, delta, lps
        finally:
            for t in tasks:
                t.cancel()

    # --- responses ------------------------------------------------------------------------
    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(ids) for ids in {id(c.prompt_ids): c.prompt_ids for c in choices}.values())
        completion = sum(c.usage.completion_tokens if c.usage else 0 for c in choices)
        # the nodes' count of prompt tokens not recomputed; a prompt shared by n choices counts once
        cached_by_prompt: dict[int, int] = {}
        for c in choices:
            held = min(c.usage.cached_tokens, len(c.prompt_ids)) if c.usage else 0
            cached_by_prompt[id(c.prompt_ids)] = max(cached_by_prompt.get(id(c.prompt_ids), 0), held)
        cached = sum(cached_by_prompt.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def run_to_end(self, req: SamplingFields, chat: bool) -> tuple[list[Choice], dict[int, str]]:
        """Run every choice of `req` to its end: the choices, and each one's whole text by index."""
        choices = await self.choices(req, chat)
        texts = {c.index: "" for c in choices}
        async for c, delta, _ in self.run(choices):
            texts[c.index] += delta
        return choices, texts

    def response(self, id_prefix: str, obj: str, choices: list[Choice], out: list[dict]) -> dict:
        """The non-streamed response object (`obj`: text_completion | chat.completion) around the
        per-choice dicts `out`, with a fresh `{id_prefix}-...` id and the choices' usage."""
        return {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": out,
            "usage": self.usage(choices),
        }

    async def completion(self, req: CompletionRequest) -> dict:
        choices, texts = await self.run_to_end(req, chat=False)
        out = []
        for c in choices:
            prefix = (c.prompt_text or self.tokenizer.decode(c.prompt_ids)) if req.echo else ""
            lp = completion_logprobs(self.tokenizer, c.logprobs, len(prefix)) if req.logprobs is not None else None
            out.append(
                {"index": c.index, "text": prefix + texts[c.index], "logprobs": lp, "finish_reason": c.finish_reason}
            )
        return self.response("cmpl", "text_completion", choices, out)

    async def chat(self, req: ChatCompletionRequest) -> dict:
        choices, texts = await self.run_to_end(req, chat=True)
        out = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": texts[c.index]},
                "logprobs": {"content": [chat_logprob_entry(self.tokenizer, lp) for lp in c.logprobs]}
                if req.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return self.response("chatcmpl", "chat.completion", choices, out)

    async def stream(self, req: SamplingFields, chat: bool) -> AsyncIterator[str]:
        """SSE lines; errors after the first byte become one error chunk, then [DONE]."""
        choices = await self.choices(req, chat)  # 400s before streaming
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choice_list}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def gen() -> AsyncIterator[str]:
            try:
                if chat:
                    for c in choices:
                        yield chunk(
                            [
                                {
                                    "index": c.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                elif req.echo:
                    for c in choices:
                        yield chunk(
                            [
                                {
                                    "index": c.index,
                                    "text": c.prompt_text or self.tokenizer.decode(c.prompt_ids),
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                offsets = {c.index: 0 for c in choices}
                async for c, delta, lps in self.run(choices):
                    finish = c.finish_reason
                    if chat:
                        lp = (
                            {"content": [chat_logprob_entry(self.tokenizer, x) for x in lps]}
                            if req.logprobs and lps
                            else None
                        )
                        body = {
                            "index": c.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": lp,
                            "finish_reason": finish,
                        }
                    else:
                        lp = (
                            completion_logprobs(self.tokenizer, lps, offsets[c.index])
                            if req.logprobs is not None and lps
                            else None
                        )
                        body = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
                    offsets[c.index] += len(delta)
                    if delta or finish or lp:
                        yield chunk([body])
                if include_usage:
                    yield chunk([], self.usage(choices))
            except RouterError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            except Exception as e:  # a stream that already started can only report in-band
                error = {"message": str(e), "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

        return gen()
