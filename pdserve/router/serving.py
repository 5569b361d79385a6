"""Serving completions and chat completions on top of Cluster.generate."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.choices import Choice, ChoiceBuilder
from pdserve.openai_api.errors import OpenAIError, error_body
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.openai_api.responses import (
    chat_choice,
    chat_delta,
    completion_choice,
    new_response_id,
    response_body,
    usage,
)
from pdserve.openai_api.text import chat_logprob_entry, completion_logprobs
from pdserve.router.cluster import Cluster
from pdserve.router.keepalive_stream import DEFAULT_INTERVAL, KEEPALIVE_COMMENT, with_keepalive
from pdserve.router.node_state import Route
from pdserve.router.request_metrics import RequestMetrics
from pdserve.v1 import decode_pb2

STREAM_QUEUE_CHUNKS = 32
"""Chunks buffered per choice between the node stream and the HTTP response. When a client stops
reading, the queue fills, the node stream is no longer read, and gRPC flow control holds the rest
on the node: router memory per request stays bounded whatever the client does."""


ChunkShape = Callable[[Choice, str, decode_pb2.GenerateEvent], dict | None]
"""What `Server.run` sends of one event, called as the event is added to its choice with the text it
added: a response chunk's choice object, or None (nothing to send). It reads the choice's
finish_reason then, set only by the last event: read later, while the chunks queued before it still
wait to be written, it would already be set."""


class Server:
    """Builds engine-level requests from OpenAI bodies and shapes the answers."""

    def __init__(
        self,
        cluster: Cluster,
        tokenizer: Tokenizer,
        model_name: str | Sequence[str],
        max_model_len: int,
        max_prompt_tokens: int | None = None,
        metrics: RequestMetrics | None = None,
        keepalive_interval: float = DEFAULT_INTERVAL,
        *,
        generation_defaults: Mapping[str, float | int] | None = None,
        prompt_tokens_details: bool = True,
        max_model_len_cap: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.keepalive_interval = keepalive_interval
        """Seconds without a chunk before a stream sends an SSE keep-alive comment."""
        self.model_names: tuple[str, ...] = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        """Every served name (--served-model-name); a request may use any, and its response echoes it."""
        if not self.model_names:
            raise ValueError("at least one served model name is needed")
        self.model_name = self.model_names[0]
        """The first name: the metrics' model_name label."""
        self.metrics = metrics or RequestMetrics(CollectorRegistry(), self.model_name)
        self.tokenizer = tokenizer
        self.default_max_model_len = max_model_len
        self.max_model_len_cap = max_model_len_cap
        """The router's --max-model-len: a ceiling on what the nodes report."""
        self.generation_defaults = dict(generation_defaults or {})
        self.prompt_tokens_details = prompt_tokens_details
        """Report usage.prompt_tokens_details (cached_tokens); vLLM's --enable-prompt-tokens-details."""
        self.builder = ChoiceBuilder(tokenizer, lambda: self.max_model_len, max_prompt_tokens, generation_defaults)

    @property
    def max_model_len(self) -> int:
        reported = self.cluster.max_model_len() or self.default_max_model_len
        return min(reported, self.max_model_len_cap) if self.max_model_len_cap else reported

    async def choices(self, req: SamplingFields, chat: bool) -> list[Choice]:
        """Validate and tokenize in a worker thread: a multi-megabyte prompt must not stall every other
        stream on the event loop (Tokenizer.encode releases the GIL on long texts). A full admission
        queue refuses the request first (503 with Retry-After), before any work and before a stream
        starts."""
        self.cluster.check_admission()
        return await asyncio.to_thread(self.builder.choices, req)

    async def admit(self, req: SamplingFields, chat: bool) -> tuple[list[Choice], dict[int, Route], float]:
        """The request's choices, each one's first route, and when it arrived (monotonic): 400s and
        a full queue's 503 first, then each choice waits in the admission queue while the nodes are
        full, and one that finds no room in `--capacity-wait` is refused here (503 with Retry-After),
        before any work and before a stream starts."""
        started = time.monotonic()
        choices = await self.choices(req, chat)
        routes = {c.index: await self.cluster.admit(c.request) for c in choices}
        return choices, routes, started

    # --- running ------------------------------------------------------------------------
    async def run(
        self,
        choices: list[Choice],
        shape: ChunkShape,
        response_id: str,
        routes: dict[int, Route] | None = None,
        started: float | None = None,
    ) -> AsyncIterator[dict]:
        """Run all choices concurrently, each on its route from `admit` (for a request that arrived
        at `started`, monotonic); yield what `shape` makes of each event as it arrives. Choice i runs
        on the nodes as `{response_id}-{i}` (as in vLLM): a client's response id finds its requests
        in the nodes' logs."""
        routes = routes or {}
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE_CHUNKS * len(choices))

        async def one(choice: Choice) -> None:
            try:
                choice.request.request_id = f"{response_id}-{choice.index}"
                events = self.cluster.generate(choice.request, routes.get(choice.index))
                async for event in self.metrics.track(events, started):
                    body = shape(choice, choice.add(event), event)
                    if body is not None:
                        await queue.put(body)
                await queue.put(choice)  # this choice is done
            except Exception as e:  # delivered to the consumer, which owns the response
                await queue.put(e)

        tasks = [asyncio.create_task(one(c)) for c in choices]
        pending = len(choices)
        try:
            while pending:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Choice):
                    pending -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # --- responses ------------------------------------------------------------------------
    def usage(self, choices: list[Choice]) -> dict:
        # a prompt shared by n choices counts once
        prompt_lens = {c.prompt_index: len(c.request.prompt_token_ids) for c in choices}
        completion = sum(c.usage.completion_tokens if c.usage else 0 for c in choices)
        # the nodes' count of prompt tokens not recomputed
        cached_by_prompt: dict[int, int] = {}
        for c in choices:
            held = min(c.usage.cached_tokens, prompt_lens[c.prompt_index]) if c.usage else 0
            cached_by_prompt[c.prompt_index] = max(cached_by_prompt.get(c.prompt_index, 0), held)
        prompt = sum(prompt_lens.values())
        return usage(prompt, completion, sum(cached_by_prompt.values()) if self.prompt_tokens_details else None)

    async def run_to_end(self, req: SamplingFields, chat: bool) -> tuple[str, list[Choice], dict[int, str]]:
        """Run every choice of `req` to its end: the response id, the choices, and each one's whole
        text by index."""
        choices, routes, started = await self.admit(req, chat)
        texts = {c.index: "" for c in choices}
        rid = new_response_id(chat)

        def collect(choice: Choice, text: str, event: decode_pb2.GenerateEvent) -> None:
            texts[choice.index] += text  # and nothing to send: the body is written at the end

        async for _ in self.run(choices, collect, rid, routes, started):
            pass
        return rid, choices, texts

    async def completion(self, req: CompletionRequest) -> dict:
        rid, choices, texts = await self.run_to_end(req, chat=False)
        out = []
        for c in choices:
            prefix = c.prompt_as_text(self.tokenizer) if req.echo else ""
            lp = completion_logprobs(self.tokenizer, c.logprobs, len(prefix)) if req.logprobs is not None else None
            ids = (c.token_ids, list(c.request.prompt_token_ids)) if req.return_token_ids else (None, None)
            out.append(completion_choice(c.index, prefix + texts[c.index], lp, c.finish_reason, *ids))
        return response_body(False, req.model, out, self.usage(choices), rid)

    async def chat(self, req: ChatCompletionRequest) -> dict:
        rid, choices, texts = await self.run_to_end(req, chat=True)
        out = [
            chat_choice(
                c.index,
                texts[c.index],
                {"content": [chat_logprob_entry(self.tokenizer, lp) for lp in c.logprobs]} if req.logprobs else None,
                c.finish_reason,
            )
            for c in choices
        ]
        return response_body(True, req.model, out, self.usage(choices), rid)

    async def stream(self, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> AsyncIterator[str]:
        """SSE lines; errors after the first byte become one error chunk, then [DONE]."""
        choices, routes, started = await self.admit(req, chat)  # 400s and 503s before streaming
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        rid = new_response_id(chat)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choice_list}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def gen() -> AsyncIterator[str]:
            try:
                for c in choices:  # chat opens each choice with its role; echo sends the prompt first
                    if chat:
                        yield chunk([chat_delta(c.index, {"role": "assistant", "content": ""}, None, None)])
                    elif isinstance(req, CompletionRequest) and req.echo:
                        yield chunk([completion_choice(c.index, c.prompt_as_text(self.tokenizer), None, None)])
                shape = (
                    self._completion_chunk(req, choices)
                    if isinstance(req, CompletionRequest)
                    else self._chat_chunk(req)
                )
                async for item in with_keepalive(
                    self.run(choices, shape, rid, routes, started), self.keepalive_interval
                ):
                    if isinstance(item, type):  # the KeepAlive marker
                        yield KEEPALIVE_COMMENT
                    else:
                        yield chunk([item])
                if include_usage:
                    yield chunk([], self.usage(choices))
            except OpenAIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            except Exception as e:  # a stream that already started can only report in-band
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return gen()

    def _chat_chunk(self, req: ChatCompletionRequest) -> ChunkShape:
        """A chat.completion.chunk's choice for each event that adds text, logprobs or the end."""

        def shape(c: Choice, text: str, event: decode_pb2.GenerateEvent) -> dict | None:
            lps = event.logprobs
            lp = {"content": [chat_logprob_entry(self.tokenizer, x) for x in lps]} if req.logprobs and lps else None
            if not (text or c.finish_reason or lp):
                return None
            return chat_delta(c.index, {"content": text} if text else {}, lp, c.finish_reason)

        return shape

    def _completion_chunk(self, req: CompletionRequest, choices: list[Choice]) -> ChunkShape:
        """A text_completion chunk's choice for each event that adds text, logprobs, token ids
        (`return_token_ids`: the prompt's go with a choice's first chunk) or the end."""
        unsent_prompt = {c.index for c in choices} if req.return_token_ids else set()
        offsets = {c.index: 0 for c in choices}  # where each choice's next text starts (logprobs' text_offset)

        def shape(c: Choice, text: str, event: decode_pb2.GenerateEvent) -> dict | None:
            lps = event.logprobs
            lp = (
                completion_logprobs(self.tokenizer, lps, offsets[c.index]) if req.logprobs is not None and lps else None
            )
            offsets[c.index] += len(text)
            prompt_ids = list(c.request.prompt_token_ids) if c.index in unsent_prompt else None
            unsent_prompt.discard(c.index)
            ids = list(event.token_ids) if req.return_token_ids else None
            if not (text or c.finish_reason or lp or ids):
                return None
            return completion_choice(c.index, text, lp, c.finish_reason, ids, prompt_ids)

        return shape
