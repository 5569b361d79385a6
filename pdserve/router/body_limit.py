"""BodyLimit: an ASGI middleware that bounds request bodies by the bytes actually received and by
the time they take.

A Content-Length check alone is not enough: a `Transfer-Encoding: chunked` upload
has no Content-Length, and FastAPI would buffer all of it before validation. This
middleware reads the body itself, counting bytes as they arrive, answers 413 as soon
as the count passes the limit (the rest is never read, so it never lands in memory),
and otherwise replays the buffered body to the app.

It also bounds the time: the app is called as soon as the request head is parsed, so the whole
body must arrive within `body_timeout` of that, or the client gets a 408 and the connection is
closed. Without it a client dripping a byte now and then holds a connection (and a task) forever:
the header deadline (router.http_limits) ends when the head is complete.
"""

from __future__ import annotations

import asyncio
import json

from pdserve.openai_api.errors import BadRequest, OpenAIError, PayloadTooLarge, RequestTimeout, retry_after_header

DEFAULT_BODY_TIMEOUT = 60.0


class BodyLimit:
    """Wraps an ASGI app; bodies above `max_body_bytes` get a 413, bodies not complete
    `body_timeout` seconds after the request head a 408, both in the OpenAI error shape."""

    def __init__(self, app, max_body_bytes: int, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        try:
            self._check_length_header(scope)
            try:
                async with asyncio.timeout(self.body_timeout):
                    body = await self._read(receive)
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.body_timeout:g} s of its headers"
                ) from None
        except OpenAIError as e:
            return await send_error(send, e)
        replayed = False

        async def replay():
            # the whole body once, then the real channel (so a client disconnect is still seen)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_length_header(self, scope) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    raise BadRequest(f"Content-Length {value.decode('latin-1')!r} is not a non-negative integer")
                if int(value) > self.max_body_bytes:
                    raise PayloadTooLarge(f"request body larger than {self.max_body_bytes} bytes")

    async def _read(self, receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"request body larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def send_error(send, err: OpenAIError) -> None:
    """Answer `err` in the OpenAI shape from ASGI middleware (with its Retry-After, if it has one)
    and close the connection: the request's body was not read."""
    payload = json.dumps(err.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
    ]
    retry_after = retry_after_header(err)
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
