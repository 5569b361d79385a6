"""uvicorn's HTTP/1.1 protocol with its own 400s (unparsable requests: a bad Content-Length, a broken
header) in the OpenAI error shape. The app never sees such requests, so the app cannot shape them."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.openai_api.errors import BadRequest


class OpenAIErrorH11Protocol(H11Protocol):
    """H11Protocol whose parse-error response is JSON `{"error": {...}}` instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        # msg is uvicorn's generic "Invalid HTTP request received."; say what usually causes it
        body = json.dumps(
            BadRequest("the request is not valid HTTP/1.1 (a malformed Content-Length, header or chunk)").body()
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
