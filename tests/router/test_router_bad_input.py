"""Hostile input gets a 4xx in the OpenAI error shape (never a plain-text 500), and every answer is counted."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and {"type", "param", "code"} <= set(err)
    return err


@pytest.mark.parametrize(
    "path,raw",
    [
        (COMPLETIONS, b'{"model":"m","prompt":"hi","seed":9223372036854775808}'),
        (COMPLETIONS, b'{"model":"m","prompt":"hi","seed":-9223372036854775809}'),
        (COMPLETIONS, b'{"model":"m","prompt":"hi","top_k":2147483648}'),
        (COMPLETIONS, b'{"model":"m","prompt":"hi","min_tokens":4294967296,"max_tokens":2}'),
        (COMPLETIONS, b'{"model":"m","prompt":"a\\ud800b"}'),
        (COMPLETIONS, b'{"model":"m","prompt":["ok","\\udfff"]}'),
        (COMPLETIONS, b'{"model":"m","prompt":"hi","stop":["\\ud800"]}'),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":"\\ud83d"}]}'),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]}'),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}'),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":null}]}]}'),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}'),
        (CHAT, b"{not json"),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}'),  # invalid UTF-8
    ],
)
async def test_out_of_range_and_malformed_values_are_openai_400s(make_client, path, raw):
    make, tok, FakeCluster = make_client
    async with make(FakeCluster(tok.encode(" ok", add_special_tokens=False))) as c:
        r = await c.post(path, content=raw, headers={"content-type": "application/json"})
        assert assert_openai_error(r, 400)["type"] == "invalid_request_error"
        ok = await c.post(
            COMPLETIONS,
            json={
                "model": "m",
                "prompt": "hi",
                "max_tokens": 1,
                "seed": 2**63 - 1,
                "top_k": 2**31 - 1,
                "min_tokens": 1,
            },
        )
        assert ok.status_code == 200, ok.text


async def test_bad_content_length_unknown_route_and_method_are_openai_errors(make_client):
    make, _, FakeCluster = make_client
    async with make(FakeCluster([])) as c:
        r = await c.post(COMPLETIONS, content=b"{}", headers={"content-length": "abc"})
        assert_openai_error(r, 400)
        assert_openai_error(await c.get("/v1/nothing-here"), 404)
        assert_openai_error(await c.get(COMPLETIONS), 405)


async def test_chunked_body_over_the_limit_is_413_before_it_is_all_read(make_client):
    make, _, FakeCluster = make_client
    pulled = 0

    async def chunked():  # no Content-Length: httpx sends Transfer-Encoding: chunked
        nonlocal pulled
        for _ in range(1000):
            pulled += 1
            yield b"x" * 65536

    async with make(FakeCluster([]), max_body_bytes=1 << 20) as c:
        r = await c.post(COMPLETIONS, content=chunked(), headers={"content-type": "application/json"})
        assert assert_openai_error(r, 413)["code"] == "request_too_large"
        assert pulled < 40, f"the router read {pulled} chunks of a body it had to refuse"
        small = await c.post(COMPLETIONS, content=chunked_ok(), headers={"content-type": "application/json"})
        assert small.status_code == 200, small.text


async def chunked_ok():
    for part in (b'{"model":"m",', b'"prompt":"hi",', b'"max_tokens":1}'):
        yield part


async def test_every_response_is_counted_including_500s(make_client):
    make, _, FakeCluster = make_client
    registry = CollectorRegistry()
    async with make(FakeCluster([], crash=RuntimeError("a bug")), registry=registry) as c:
        r = await c.post(COMPLETIONS, json={"model": "m", "prompt": "hi"})
        assert assert_openai_error(r, 500)["type"] == "server_error"
        await c.post(COMPLETIONS, content=b"{", headers={"content-type": "application/json"})
    count = lambda status: registry.get_sample_value(  # noqa: E731
        "pdserve_router_requests_total", {"model_name": "m", "route": COMPLETIONS, "status": status}
    )
    assert count("500") == 1 and count("400") == 1
