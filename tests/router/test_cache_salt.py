"""vLLM's cache_salt field (validated, passed on) and usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import json

import pytest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_cache_salt_reaches_the_cluster(make_client, path, body):
    make, tok, FakeCluster = make_client
    cluster = FakeCluster(tok.encode(" a b", add_special_tokens=False))
    async with make(cluster) as c:
        assert (await c.post(path, json={**body, "cache_salt": "tenant-é"})).status_code == 200
        assert (await c.post(path, json=body)).status_code == 200
    assert cluster.salts == ["tenant-é", None]


@pytest.mark.parametrize(
    "salt,why",
    [(7, "string"), ("", "at least 1"), (["a"], "string"), ("é" * 129, "256 bytes"), ({"a": 1}, "string")],
)
@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_bad_cache_salt_is_a_400_naming_the_field(make_client, path, body, salt, why):
    make, _, FakeCluster = make_client
    cluster = FakeCluster([1])
    async with make(cluster) as c:
        r = await c.post(path, json={**body, "cache_salt": salt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and why in err["message"]
    assert cluster.requests == []


async def test_256_byte_salt_is_accepted(make_client):
    make, tok, FakeCluster = make_client
    cluster = FakeCluster([1])
    async with make(cluster) as c:
        assert (await c.post("/v1/completions", json={**COMPLETION, "cache_salt": "é" * 128})).status_code == 200


async def test_cached_tokens_come_from_the_node_streamed_or_not_and_count_once_per_prompt(make_client):
    make, tok, FakeCluster = make_client
    cluster = FakeCluster(tok.encode(" a b", add_special_tokens=False))
    cluster.cached_tokens = 1
    async with make(cluster) as c:
        full = (await c.post("/v1/completions", json=COMPLETION)).json()
        assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
        two = (await c.post("/v1/chat/completions", json={**CHAT, "n": 2})).json()
        assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}  # one prompt, computed once
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        r = await c.post("/v1/chat/completions", json=body)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
