"""The HTTP layer against a fake cluster: health, errors after a stream started, stop strings, shapes."""

from __future__ import annotations

import json

import pytest


async def test_health_is_503_without_a_healthy_pair(make_client):
    make, _, FakeCluster = make_client
    async with make(FakeCluster([], healthy=False)) as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


async def test_error_after_stream_started_is_an_error_chunk_then_done(make_client):
    make, tok, FakeCluster = make_client
    tokens = tok.encode(" one two three four five", add_special_tokens=False)
    async with make(FakeCluster(tokens, fail_after=2)) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 10, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["message"] == "decode node vanished"
        assert any(json.loads(e).get("choices") for e in events[:-2])  # text was streamed before the failure


async def test_stop_string_is_cut_in_stream_and_in_full_response(make_client):
    make, tok, FakeCluster = make_client
    tokens = tok.encode(" alpha beta gamma delta", add_special_tokens=False)
    async with make(FakeCluster(tokens)) as c:
        body = {"model": "m", "prompt": "x", "max_tokens": 20, "stop": ["gam"]}
        full = (await c.post("/v1/completions", json=body)).json()
        assert full["choices"][0]["text"] == " alpha beta "
        r = await c.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == " alpha beta "


async def test_request_mapping_and_chat_shape(make_client):
    make, tok, FakeCluster = make_client
    cluster = FakeCluster(tok.encode(" hello", add_special_tokens=False))
    async with make(cluster) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 5,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 7,
                "presence_penalty": 0.5,
                "stop": "zz",
            },
        )
        body = r.json()
        assert r.status_code == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": " hello"}
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        prompt, params = cluster.requests[-1]
        assert prompt == tok.encode_chat([{"role": "user", "content": "hi"}])
        assert (params.max_tokens, params.seed, list(params.stop)) == (5, 7, ["zz"])
        assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_nodes_run_choice_i_as_the_response_id_dash_i(make_client, path, stream):
    """A client's response id finds its requests in the nodes' logs (vLLM's `cmpl-X` -> `cmpl-X-i`)."""
    make, tok, FakeCluster = make_client
    cluster = FakeCluster(tok.encode(" hi there", add_special_tokens=False))
    body = {"model": "m", "max_tokens": 3, "n": 2, "stream": stream}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    async with make(cluster) as c:
        r = await c.post(path, json=body)
        assert r.status_code == 200
        if stream:
            ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
        else:
            ids = {r.json()["id"]}
    assert len(ids) == 1
    (rid,) = ids
    assert rid.startswith("chatcmpl-" if "chat" in path else "cmpl-")
    assert sorted(cluster.request_ids) == [f"{rid}-0", f"{rid}-1"]
