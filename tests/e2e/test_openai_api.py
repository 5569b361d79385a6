"""The OpenAI Python SDK (max_retries=0) against a real cluster on the built-in model."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest

from tests.e2e.cluster import stop
from tests.e2e.grpc_client import load
from tests.e2e.router_cluster import API_KEY, metric_value, start_full

pytestmark = pytest.mark.e2e
MODEL = "pdserve-tiny"


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    cluster, router, base = start_full(str(tiny_model_dir))
    try:
        yield cluster, base
    finally:
        stop(router)
        cluster.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack[1] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_stream_match_at_temperature_zero(client):
    full = client.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens + full.usage.completion_tokens == full.usage.total_tokens
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The lighthouse keeper", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


def test_chat_and_stream_with_usage(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text == full.choices[0].message.content
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    assert usage.completion_tokens == full.usage.completion_tokens


def test_n_and_seed(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=3
    )
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert out.usage.completion_tokens == 12


def test_stop_strings(client):
    base = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip("generated text too short to pick a stop string")
    out = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=16,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == out.choices[0].text


def test_logprobs(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-5  # greedy picks the top token
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == 3
    assert all(len(t) <= 2 for t in comp.choices[0].logprobs.top_logprobs)


def test_token_id_prompts_batches_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 5
    echo = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Echo me")


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "", "max_tokens": 4},
        {"prompt": "word " * 5000, "max_tokens": 4},
        {"prompt": "hi", "max_tokens": 10**6},
        {"prompt": "hi", "logprobs": 21},
        {"prompt": [-1, 5], "max_tokens": 2},
        {"prompt": [10**7], "max_tokens": 2},
        {"prompt": "hi", "max_tokens": "many"},
        {"prompt": "hi", "temperature": "hot"},
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        {"prompt": "hi", "n": 0},
    ],
)
def test_completion_bad_input_is_400(stack, body):
    base = stack[1]
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "param" in err and "code" in err
    ok = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert ok.status_code == 200


def test_chat_bad_input_invalid_json_unknown_model_and_keys(stack):
    base = stack[1]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        headers=auth,
    )
    assert r.status_code == 400
    r = httpx.post(
        f"{base}/v1/chat/completions", content=b"{not json", headers={**auth, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": "hello"}, headers=auth)
    assert r.status_code == 400
    r = httpx.post(f"{base}/v1/completions", json={"model": "gpt-9", "prompt": "x"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(
        f"{base}/v1/completions", content=b"x" * (5 * 1024 * 1024), headers={**auth, "content-type": "application/json"}
    )
    assert r.status_code == 413


def test_chunked_upload_over_the_limit_is_413_not_buffered(stack):
    """Transfer-Encoding: chunked carries no Content-Length; the limit holds on the bytes actually read."""
    host, port = stack[1].rsplit("//", 1)[1].split(":")
    chunk = b"x" * 65536
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        sent = 0
        try:
            while sent < 64 * 1024 * 1024:  # 64 MiB offered; the router must answer long before
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the router answered and closed the connection
        head = s.recv(65536).split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 413"), head
    assert sent < 64 * 1024 * 1024


def test_health_metrics_and_openapi(stack):
    base = stack[1]
    assert httpx.get(f"{base}/health").status_code == 200
    assert "pdserve_router_requests_total" in httpx.get(f"{base}/metrics").text
    spec = httpx.get(f"{base}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_a_client_that_leaves_mid_stream_ends_its_request_on_the_nodes(stack):
    """The router's middlewares pass the client's disconnect through: the node stops generating and
    frees the blocks long before the request's max_tokens would have run out."""
    cluster, base = stack
    aborted_before = _aborted(base)
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    # the connection is closed here, with ~1,497 tokens still to go

    async def drained() -> bool:
        reports = [await load(d.address, cluster.secret, "decode") for d in cluster.decodes]
        return all(rep.num_running == 0 and rep.num_free_blocks == rep.num_total_blocks for rep in reports)

    deadline = time.monotonic() + 5
    while not asyncio.run(drained()):
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.1)
    assert _aborted(base) == aborted_before + 1


def _aborted(base: str) -> float:
    """The router's count of requests that ended without a finish reason (vllm:request_success)."""
    return metric_value(httpx.get(f"{base}/metrics").text, "vllm:request_success_total", finished_reason="abort")


def test_no_blocks_leak_after_the_suite(stack):
    cluster = stack[0]

    async def check() -> None:
        await asyncio.sleep(0.5)
        for proc in cluster.all():
            report = await load(proc.address, cluster.secret, proc.role)
            assert report.num_free_blocks == report.num_total_blocks, proc.role

    asyncio.run(check())
