"""A client that never reads cannot grow router memory, and tokenization stays off the event loop."""

from __future__ import annotations

import asyncio
import threading

from pdserve.engine.tokenizer import Tokenizer
from pdserve.openai_api.protocol import CompletionRequest
from pdserve.router.serving import STREAM_QUEUE_CHUNKS, Server
from pdserve.v1 import decode_pb2


class EndlessCluster:
    """A node stream that has as many tokens as anyone will read; counts what was pulled from it."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.pulled = 0

    def max_model_len(self) -> int:
        return 10**6

    def check_admission(self) -> None:
        """Never full."""

    async def admit(self, request):
        """Always room: the route is opaque to the Server."""
        return None

    async def generate(self, request, route=None):
        while True:
            self.pulled += 1
            yield decode_pb2.GenerateEvent(token_ids=[self.token])


async def test_a_reader_that_stops_reading_stops_the_node_stream(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    cluster = EndlessCluster(tok.encode(" a", add_special_tokens=False)[0])
    server = Server(cluster, tok, "m", 10**6)
    choices = await server.choices(CompletionRequest(model="m", prompt="hi", max_tokens=500_000, n=2), chat=False)
    stream = server.run(choices, lambda choice, text, event: {"index": choice.index, "text": text}, "cmpl-test")
    try:
        for _ in range(10):  # the client reads a little, then never again
            await stream.__anext__()
        for _ in range(50):
            await asyncio.sleep(0.01)
        # unbounded, the producers would have pulled thousands of chunks by now
        assert cluster.pulled <= 10 + 2 * (STREAM_QUEUE_CHUNKS + 1), cluster.pulled
    finally:
        await stream.aclose()


async def test_prompts_are_tokenized_off_the_event_loop(tiny_model_dir, monkeypatch):
    tok = Tokenizer(tiny_model_dir)
    threads: list[int] = []
    encode = tok.encode

    def spy(text, add_special_tokens=True):
        threads.append(threading.get_ident())
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", spy)
    server = Server(EndlessCluster(0), tok, "m", 10**6)
    big = "The quick brown fox jumps over the lazy dog. " * 2000
    choices = await server.choices(CompletionRequest(model="m", prompt=big, max_tokens=1), chat=False)
    assert len(choices[0].request.prompt_token_ids) > 10_000
    assert threads and threading.get_ident() not in threads
