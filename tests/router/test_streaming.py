"""Streamed chunks: finish_reason only on each choice's last chunk whatever the reader's pace, and
SSE keep-alive comments while a stream waits for its first token."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.keepalive_stream import KEEPALIVE_COMMENT, KeepAlive, with_keepalive
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.serving import Server
from tests.router.paced import PacedCluster


def events(lines: list[str]) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


async def read_slowly(stream, delay: float) -> list[str]:
    out = []
    async for line in stream:
        out.append(line)
        await asyncio.sleep(delay)  # the producer runs ahead and fills the chunk queue
    return out


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("n", [1, 3])
async def test_finish_reason_is_only_on_the_last_chunk_of_each_choice_for_a_slow_reader(tiny_model_dir, chat, n):
    tok = Tokenizer(tiny_model_dir)
    server = Server(PacedCluster(list(range(300, 340)), pace=0.001), tok, "m", 128)
    if chat:
        req = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, n=n, stream=True
        )
    else:
        req = CompletionRequest(model="m", prompt="hello", max_tokens=12, n=n, stream=True)
    lines = await read_slowly(await server.stream(req, chat=chat), delay=0.01)
    assert lines[-1] == "data: [DONE]\n\n"
    for index in range(n):
        chunks = [c["choices"][0] for c in events(lines) if c["choices"] and c["choices"][0]["index"] == index]
        reasons = [c["finish_reason"] for c in chunks]
        assert reasons[-1] == "length" and reasons.count("length") == 1, reasons


async def test_keepalive_comments_while_waiting_for_the_first_token(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    server = Server(PacedCluster([300, 301], first_delay=0.5), tok, "m", 128, keepalive_interval=0.1)
    req = CompletionRequest(model="m", prompt="hello", max_tokens=2, stream=True)
    lines = [line async for line in await server.stream(req, chat=False)]
    first_data = next(i for i, x in enumerate(lines) if x.startswith("data: {"))
    assert lines[:first_data].count(KEEPALIVE_COMMENT) >= 2  # ~5 intervals of silence
    assert all(x == KEEPALIVE_COMMENT for x in lines[:first_data])
    assert [c["choices"][0]["finish_reason"] for c in events(lines)] == [None, "length"]


async def test_keepalive_passes_items_through_and_refuses_a_bad_interval():
    async def items():
        for i in range(3):
            await asyncio.sleep(0.05 if i == 1 else 0)
            yield i

    got = [x async for x in with_keepalive(items(), 0.01)]
    assert [x for x in got if x is not KeepAlive] == [0, 1, 2] and KeepAlive in got
    with pytest.raises(ValueError):
        [x async for x in with_keepalive(items(), 0)]
