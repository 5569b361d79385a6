"""vLLM's endpoints and serving options on the router's app (fake cluster): /tokenize round-trips through
/detokenize, bad input is a 400 in the OpenAI shape, /ping answers GET and POST, several served names,
generation_config defaults, and usage with or without prompt_tokens_details."""

from __future__ import annotations

import httpx
import pytest

from pdserve.router.app import create_app
from pdserve.router.serving import Server


@pytest.fixture
def client(make_client):
    _, tok, FakeCluster = make_client

    def make(cluster=None, names=("m",), **server_kwargs) -> httpx.AsyncClient:
        server = Server(cluster or FakeCluster(tok.encode(" hello", add_special_tokens=False)), tok, names, 128,
                        **server_kwargs)  # fmt: skip
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(server)), base_url="http://test")

    return make, tok, FakeCluster


def assert_openai_400(r: httpx.Response, param: str | None = None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


async def test_tokenize_round_trips_through_detokenize(client):
    make, tok, _ = client
    text = "The old lighthouse keeper, héllo 世界!"
    async with make() as c:
        r = await c.post("/tokenize", json={"model": "m", "prompt": text})
        body = r.json()
        assert r.status_code == 200 and body["tokens"] == tok.encode(text)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128 and body["token_strs"] is None
        plain = (await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
        assert plain == tok.encode(text, add_special_tokens=False) and len(plain) < body["count"]
        back = await c.post("/detokenize", json={"model": "m", "tokens": plain})
        assert back.status_code == 200 and back.json() == {"prompt": text}
        strs = (await c.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()["token_strs"]
        assert len(strs) == body["count"]


async def test_tokenize_messages_is_what_a_chat_request_sends(client):
    make, tok, FakeCluster = client
    cluster = FakeCluster(tok.encode(" hi", add_special_tokens=False))
    messages = [{"role": "user", "content": "hello there"}]
    async with make(cluster) as c:
        r = (await c.post("/tokenize", json={"messages": messages})).json()
        await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
        assert r["tokens"] == cluster.requests[0][0] == tok.encode_chat(messages)
        no_prompt = (await c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        assert no_prompt["count"] < r["count"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/detokenize", {"tokens": [1, -2]}, None),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
async def test_bad_tokenize_input_is_a_400_in_the_openai_shape(client, path, body, param):
    make, _, _ = client
    async with make() as c:
        assert_openai_400(await c.post(path, json=body), param)
        assert_openai_400(await c.post(path, content=b"{nope", headers={"content-type": "application/json"}))


async def test_a_template_that_refuses_the_conversation_is_a_400(client, tiny_model_dir):
    from pdserve.engine.tokenizer import Tokenizer
    from tests.router.conftest import FakeCluster

    tok = Tokenizer(tiny_model_dir, chat_template="{{ raise_exception('no system role') }}")
    app = create_app(Server(FakeCluster([1]), tok, "m", 128))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.post("/tokenize", json={"messages": [{"role": "system", "content": "x"}]})
        assert_openai_400(r, "messages")
        assert "no system role" in r.json()["error"]["message"]


async def test_unknown_model_on_tokenize_is_a_404(client):
    make, _, _ = client
    async with make() as c:
        r = await c.post("/tokenize", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_ping_and_version(client):
    make, _, FakeCluster = client
    async with make() as c:
        assert (await c.get("/ping")).status_code == 200
        assert (await c.post("/ping")).status_code == 200
        assert (await c.get("/version")).json()["version"]
    async with make(FakeCluster([], healthy=False)) as c:
        for r in (await c.get("/ping"), await c.post("/ping")):
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"


async def test_every_served_name_is_listed_and_answers_under_its_own_name(client):
    make, _, _ = client
    async with make(names=("alpha", "beta")) as c:
        models = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["alpha", "beta"]
        assert all(m["max_model_len"] == 128 and m["root"] == "alpha" for m in models)
        for name in ("alpha", "beta"):
            r = await c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == name
            r = await c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1, "stream": True})
            assert f'"model": "{name}"' in r.text
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 404 and "'alpha', 'beta'" in r.json()["error"]["message"]


async def test_generation_defaults_apply_only_to_unset_fields(client):
    make, _, FakeCluster = client
    cluster = FakeCluster([5])
    defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 3}
    async with make(cluster, generation_defaults=defaults) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["sampling_defaults"] == defaults
        await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        await c.post("/v1/completions", json={"model": "m", "prompt": "x", "temperature": 0.9, "top_k": -1})
    unset, given = cluster.requests[0][1], cluster.requests[1][1]
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == pytest.approx((0.25, 0.5, 7, 3))
    assert unset.repetition_penalty == pytest.approx(1.2)
    assert (given.temperature, given.top_k, given.top_p) == pytest.approx((0.9, -1, 0.5))


async def test_prompt_tokens_details_can_be_left_out_like_vllm(client):
    make, _, FakeCluster = client
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    async with make(FakeCluster([5])) as c:
        assert "prompt_tokens_details" in (await c.post("/v1/completions", json=body)).json()["usage"]
    async with make(FakeCluster([5]), prompt_tokens_details=False) as c:
        usage = (await c.post("/v1/completions", json=body)).json()["usage"]
        assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0


async def test_the_routers_max_model_len_caps_what_nodes_report(client):
    make, _, _ = client
    async with make(max_model_len_cap=20) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["max_model_len"] == 20
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 30})
        assert_openai_400(r)


async def test_a_lone_surrogate_in_a_tokenize_prompt_is_a_400(client):
    make, _, _ = client
    async with make() as c:
        r = await c.post("/tokenize", content=b'{"prompt": "a\\ud800"}', headers={"content-type": "application/json"})
        assert_openai_400(r)
