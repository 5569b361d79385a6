"""Guard (router/guard.py), the router's outermost ASGI middleware, on bare ASGI apps: what it does
before a response starts, after, and when an app never answers."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.openai_api.errors import NoCapacityError
from pdserve.router.guard import Guard
from pdserve.router.http_metrics import HttpMetrics


class Recorder:
    """An ASGI `send` that keeps every message."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, message: dict) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


async def receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def scope(path: str = "/v1/completions", headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers or []}


def guarded(app, keys: list[bytes] | None = None) -> tuple[Guard, CollectorRegistry]:
    registry = CollectorRegistry()
    return Guard(app, keys or [], HttpMetrics(registry, "m"), lambda: []), registry


def counted(registry: CollectorRegistry, status: str) -> float | None:
    return registry.get_sample_value(
        "pdserve_router_requests_total", {"model_name": "m", "route": "other", "status": status}
    )


async def streams_two_chunks(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    await send({"type": "http.response.body", "body": b"b", "more_body": False})


async def test_a_stream_passes_through_unchanged_and_is_counted_once():
    guard, registry = guarded(streams_two_chunks)
    sent = Recorder()
    await guard(scope(), receive, sent)
    assert [m["type"] for m in sent.messages] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent.body == b"ab" and counted(registry, "200") == 1


async def test_a_key_is_checked_on_v1_only_and_the_first_authorization_header_counts():
    guard, registry = guarded(streams_two_chunks, keys=[b"k1"])
    for headers, status in (
        ([], 401),
        ([(b"authorization", b"Bearer wrong")], 401),
        ([(b"authorization", b"Bearer wrong"), (b"authorization", b"Bearer k1")], 401),
        ([(b"authorization", b"Bearer k1")], 200),
    ):
        sent = Recorder()
        await guard(scope(headers=headers), receive, sent)
        assert sent.status == status, headers
    sent = Recorder()
    await guard(scope("/health"), receive, sent)  # no key needed off /v1/
    assert sent.status == 200
    assert counted(registry, "401") == 3 and counted(registry, "200") == 2


@pytest.mark.parametrize(
    "error, status, kind",
    [(NoCapacityError("full"), 503, "server_error"), (RuntimeError("a bug"), 500, "server_error")],
)
async def test_an_error_before_the_response_is_an_openai_error_and_counted(error, status, kind):
    async def fails(scope, receive, send) -> None:
        raise error

    guard, registry = guarded(fails)
    sent = Recorder()
    await guard(scope(), receive, sent)
    assert sent.status == status and b'"type":"' + kind.encode() + b'"' in sent.body
    assert counted(registry, str(status)) == 1


async def test_an_error_mid_stream_cuts_the_stream_instead_of_a_second_response():
    async def fails_mid_stream(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        raise RuntimeError("lost the node")

    guard, registry = guarded(fails_mid_stream)
    sent = Recorder()
    with pytest.raises(RuntimeError, match="lost the node"):
        await guard(scope(), receive, sent)
    # no second response start, and the stream never claims to be complete
    assert [m["type"] for m in sent.messages] == ["http.response.start", "http.response.body"]
    assert sent.messages[-1]["more_body"] is True and counted(registry, "200") == 1


async def test_an_app_that_never_answers_gets_a_500():
    async def silent(scope, receive, send) -> None:
        return None

    guard, registry = guarded(silent)
    sent = Recorder()
    await guard(scope(), receive, sent)
    assert sent.status == 500 and counted(registry, "500") == 1


async def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["type"])

    guard, _ = guarded(app, keys=[b"k"])
    await guard({"type": "lifespan"}, receive, Recorder())
    assert seen == ["lifespan"]


async def test_garbage_in_the_authorization_header_is_a_401_never_a_500():
    guard, registry = guarded(streams_two_chunks, keys=[b"k\xff"])
    for value, status in (
        (b"Bearer \xff\xfe\x00", 401),
        (b"Bearer " + b"x" * 100_000, 401),
        ("Bearer 🙂".encode(), 401),
        (b"bearer   k\xff  ", 200),  # any case of the scheme, blanks around the key, a non-ASCII key byte
    ):
        sent = Recorder()
        await guard(scope(headers=[(b"authorization", value)]), receive, sent)
        assert sent.status == status, value[:20]
    assert counted(registry, "500") is None
