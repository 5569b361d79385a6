"""`return_token_ids` on /v1/completions (vLLM's field): the generated ids, and the prompt's once,
so that a multi-turn client can append exactly what the model produced."""

from __future__ import annotations

import json

import pytest

TOKENS = list(range(300, 310))


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_a_completion_returns_the_generated_and_the_prompt_token_ids(make_client):
    make, _, fake = make_client
    async with make(fake(TOKENS)) as client:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 6, "n": 2, "return_token_ids": True}
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["token_ids"] == TOKENS[:6]
        assert choice["prompt_token_ids"] == [5, 6, 7]


async def test_without_the_field_no_ids_are_returned(make_client):
    make, _, fake = make_client
    async with make(fake(TOKENS)) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 3})
    assert "token_ids" not in r.json()["choices"][0] and "prompt_token_ids" not in r.json()["choices"][0]


async def test_a_stream_sends_each_chunks_new_ids_and_the_prompt_ids_once_per_choice(make_client):
    make, _, fake = make_client
    async with make(fake(TOKENS)) as client:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "n": 2, "stream": True, "return_token_ids": True}
        r = await client.post("/v1/completions", json=body)
    ids: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list] = {0: [], 1: []}
    for event in events(r.text):
        for choice in event["choices"]:
            ids[choice["index"]] += choice.get("token_ids", [])
            if "prompt_token_ids" in choice:
                prompts[choice["index"]].append(choice["prompt_token_ids"])
    assert ids == {0: TOKENS[:8], 1: TOKENS[:8]}
    assert prompts == {0: [[5, 6, 7]], 1: [[5, 6, 7]]}


@pytest.mark.parametrize("value, status", [(True, 400), (False, 200)])
async def test_chat_refuses_it_unless_it_asks_nothing(make_client, value, status):
    make, _, fake = make_client
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "return_token_ids": value}
    async with make(fake(TOKENS)) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "return_token_ids"
