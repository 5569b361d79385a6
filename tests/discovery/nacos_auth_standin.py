"""A Nacos stand-in behind Nacos's auth (login and access tokens, ak/sk request signatures), served on
127.0.0.1, and the helpers the Nacos auth tests share (tests/discovery/test_nacos_auth.py,
test_nacos_secrets.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from urllib.parse import urlparse


from pdserve.node_runtime.discovery import (
    Member,
)
from tests.discovery.nacos_standin import NacosStandIn

LOGIN = "/nacos/v1/auth/login"
USER, PASSWORD = "pdserve", "pa ss&wörd=1%"  # characters that URL encoding changes, to catch encoded leaks
ACCESS_KEY, SECRET_KEY = "AK-test", "sk/+=SECRET-0123456789"


class AuthNacos(NacosStandIn):
    """NacosStandIn behind Nacos's auth: POST /nacos/v1/auth/login answers an accessToken for a known
    user (403 "unknown user!" otherwise); a naming request needs a token it issued, or a valid
    access-key signature (`ak`, `data`, `signature`, with `data` naming this request's service).
    Every request is recorded. Use `standin()` for a subclass with its own state."""

    users: dict[str, str] = {}
    keys: dict[str, str] = {}
    tokens: list[str] = []
    seen: list[tuple[str, str, dict[str, str]]] = []
    """(method, path, parameters) of every request, in arrival order."""

    def _params(self) -> dict[str, str]:
        if "_parsed" not in self.__dict__:  # read the body once: the base handlers read it again
            self._parsed = super()._params()
        return self._parsed

    def _signed(self, p: dict[str, str]) -> bool:
        secret, data = self.keys.get(p.get("ak", "")), p.get("data", "")
        if secret is None or not p.get("serviceName"):
            return False
        name = p["serviceName"] if "@@" in p["serviceName"] else f"{p.get('groupName')}@@{p['serviceName']}"
        expected = base64.b64encode(hmac.new(secret.encode(), data.encode(), hashlib.sha1).digest()).decode()
        return data.endswith("@@" + name) and hmac.compare_digest(expected, p.get("signature", ""))

    def _guarded(self, method: str, serve: Callable[[], None]) -> None:
        p = self._params()
        path = urlparse(self.path).path
        self.seen.append((method, path, dict(p)))
        if path == LOGIN:
            if self.users.get(p.get("username", "")) != p.get("password") or "password" not in p:
                return self._reply("unknown user!", 403)
            token = secrets.token_hex(16)
            self.tokens.append(token)
            return self._reply({"accessToken": token, "tokenTtl": 18000, "globalAdmin": False})
        if p.get("accessToken") not in self.tokens and not self._signed(p):
            return self._reply("no permission", 403)
        serve()

    def do_POST(self) -> None:
        self._guarded("POST", super().do_POST)

    def do_PUT(self) -> None:
        self._guarded("PUT", super().do_PUT)

    def do_DELETE(self) -> None:
        self._guarded("DELETE", super().do_DELETE)

    def do_GET(self) -> None:
        self._guarded("GET", super().do_GET)


def standin(users: dict[str, str] | None = None, keys: dict[str, str] | None = None) -> type[AuthNacos]:
    fresh = {"instances": {}, "last_beat": {}, "beats": [], "seen": [], "tokens": []}
    return type("AuthNacosCase", (AuthNacos,), {**fresh, "users": users or {}, "keys": keys or {}})


@contextlib.contextmanager
def serving(handler: type[AuthNacos], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """The stand-in on 127.0.0.1 (a free port), ready to accept; stopped however the test ends."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "stand-in never accepted a connection"
                time.sleep(0.05)
        yield f"{'https://' if tls else ''}127.0.0.1:{port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def independent_signature(secret: str, data: str) -> str:
    """Nacos's naming signature, as its open API documents it: base64(HMAC-SHA1(secret key, data))."""
    return base64.b64encode(hmac.new(secret.encode("utf-8"), data.encode("utf-8"), hashlib.sha1).digest()).decode()


DECODE = Member("decode", "127.0.0.1", 50071, {"cachestore_port": 50081})
