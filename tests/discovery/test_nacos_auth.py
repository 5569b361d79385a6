"""Nacos discovery against a Nacos that demands auth: the REAL nacos-sdk-python 2.0.x client (its login,
its access tokens, its request signing) talks to a local stand-in (tests/discovery/nacos_standin.py)
that checks credentials as Nacos does. What is pinned:

- username/password: the SDK logs in with them, and every later request carries the token the
  server returned (never the password);
- access key/secret key: every naming request carries `ak`, `data` and `signature`, and the
  signature verifies under the secret key, computed here independently (base64 HMAC-SHA1 of
  `data`, which names the timestamp, group and service of that very request);
- a rejected login or signature ends in one DiscoveryAuthError that says so, for a node (register,
  and `pdserve prefill|decode`'s serve: exit 2, no READY) and for the router (start);
- https: the server's certificate is verified (the SDK alone would not check it), so the password
  never goes to a server the CA did not sign;
- secrets stay out of logs (the SDK's own records included, at DEBUG), reprs, errors and --help;
- half-given credentials are refused at start, naming the flag.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import io
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from pdserve.node_runtime.discovery import (
    DiscoveryAuthError,
    DiscoveryConfig,
    DiscoveryError,
    Member,
    add_discovery_args,
    discovery_from_config,
)
from pdserve.node_runtime.discovery.nacos import NacosDiscovery
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


@pytest.fixture
def sdk_logs(monkeypatch) -> None:
    """The SDK's records reach caplog: its constructor turns propagation off when it finds no handler
    at all (a process that has not configured logging), whatever ran earlier in this process."""
    monkeypatch.setattr(logging.getLogger("nacos.client"), "propagate", True)


DECODE = Member("decode", "127.0.0.1", 50071, {"cachestore_port": 50081})


async def test_login_then_every_request_carries_the_token():
    handler = standin(users={USER: PASSWORD})
    with serving(handler) as server:
        node = NacosDiscovery(server, service="t", heartbeat=0.2, username=USER, password=PASSWORD)
        assert handler.seen == []  # the SDK's constructor would log in at once; ours waits for the first call
        try:
            await node.register(DECODE)
            await until(lambda: any(path.endswith("/beat") for _, path, _ in handler.seen), "an SDK heartbeat")
        finally:
            await node.stop()
        (method, path, login), *later = handler.seen
        assert (method, path) == ("POST", LOGIN)
        assert (login["username"], login["password"]) == (USER, PASSWORD)
        assert handler.tokens and later
        for _, path, p in later:  # register, beats, deregister
            assert p.get("accessToken") == handler.tokens[0], path
            assert "password" not in p and "username" not in p
        assert {path for _, path, _ in later} >= {"/nacos/v1/ns/instance", "/nacos/v1/ns/instance/beat"}

        router = NacosDiscovery(server, service="t", username=USER, password=PASSWORD)
        await node.register(DECODE)  # still logged in: the token is reused
        assert [path for _, path, _ in handler.seen].count(LOGIN) == 1
        try:
            await router.refresh()
            assert [m.address for m in router.members("decode")] == ["127.0.0.1:50071"]
            assert handler.seen[-1][2]["accessToken"] == handler.tokens[-1] != handler.tokens[0]  # its own login
        finally:
            await node.stop()
            await router.stop()


async def test_access_key_requests_carry_a_signature_that_verifies():
    handler = standin(keys={ACCESS_KEY: SECRET_KEY})
    with serving(handler) as server:
        node = NacosDiscovery(server, service="t", heartbeat=0.2, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        router = NacosDiscovery(server, service="t", access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        try:
            await node.register(DECODE)
            await until(lambda: any(path.endswith("/beat") for _, path, _ in handler.seen), "an SDK heartbeat")
            await router.refresh()
            assert [m.port for m in router.members("decode")] == [50071]
        finally:
            await node.stop()
            await router.stop()
        kinds = {(method, path) for method, path, _ in handler.seen}
        assert {("POST", "/nacos/v1/ns/instance"), ("PUT", "/nacos/v1/ns/instance/beat")} <= kinds
        assert ("GET", "/nacos/v1/ns/instance/list") in kinds and ("DELETE", "/nacos/v1/ns/instance") in kinds
        now_ms = time.time() * 1000
        for method, path, p in handler.seen:
            assert p["ak"] == ACCESS_KEY, (method, path)
            timestamp, _, signed = p["data"].partition("@@")
            # the signed text binds the request's own service (group@@name) and a millisecond clock
            assert signed == f"DEFAULT_GROUP@@t-{'prefill' if 'prefill' in p['serviceName'] else 'decode'}"
            assert timestamp.isdigit() and abs(int(timestamp) - now_ms) < 3_600_000
            assert p["signature"] == independent_signature(SECRET_KEY, p["data"])
            assert SECRET_KEY not in str(p)

        # a wrong secret key signs differently: the server refuses, the node says which flag to check
        handler.seen.clear()
        wrong = NacosDiscovery(server, service="t", access_key=ACCESS_KEY, secret_key="not-the-key")
        with pytest.raises(DiscoveryAuthError) as refused:
            await wrong.register(DECODE)
        assert "--nacos-access-key 'AK-test'" in str(refused.value) and "HTTP 403" in str(refused.value)
        assert handler.seen[0][2]["signature"] != independent_signature(SECRET_KEY, handler.seen[0][2]["data"])
        assert not wrong.client.heartbeats
        await wrong.stop()


async def test_rejected_login_is_one_clear_error_for_node_and_router(caplog, sdk_logs):
    handler = standin(users={USER: PASSWORD})
    with serving(handler) as server:
        node = NacosDiscovery(server, service="t", username=USER, password="wrong-password")
        with pytest.raises(DiscoveryAuthError) as rejected:
            await node.register(DECODE)
        message = str(rejected.value)
        assert f"nacos at {server} rejected the login of user {USER!r} (HTTP 403)" in message
        assert "wrong-password" not in message and "Traceback" not in message
        assert [path for _, path, _ in handler.seen] == [LOGIN]  # nothing after the refused login
        assert not node.client.heartbeats
        await node.stop()

        router = NacosDiscovery(server, service="t", username=USER, password="wrong-password")
        with pytest.raises(DiscoveryAuthError, match="rejected the login"):
            await router.start()
        assert not router._tasks  # no subscription left retrying forever
        await router.stop()

        # no credentials at all, against a Nacos that wants them: refused, with what to set
        anonymous = NacosDiscovery(server, service="t")
        with pytest.raises(DiscoveryAuthError, match="requires auth: set --nacos-username"):
            await anonymous.register(DECODE)
        with pytest.raises(DiscoveryAuthError, match="listing the prefill nodes"):
            await anonymous.start()
        await anonymous.stop()
    assert "wrong-password" not in caplog.text
    # the SDK's own failure records come without their tracebacks (we report in one line)
    assert not [r for r in caplog.records if r.name.startswith("nacos") and (r.exc_info or r.exc_text)]


class FakeNode:
    """What node_common.serve needs of a node, without an engine."""

    def __init__(self) -> None:
        self.rt = type("Rt", (), {"node_id": "n1", "failed": asyncio.Event()})()
        self.stopped: list[bool] = []

    async def start(self) -> str:
        return "127.0.0.1:50071"

    def discovery_meta(self) -> dict[str, str]:
        return {"cachestore_port": "50081"}

    async def stop(self, drain: bool = True) -> None:
        self.stopped.append(drain)


def test_a_node_whose_login_is_rejected_exits_2_saying_why(capsys, monkeypatch):
    from pdserve.commands import node_common
    from pdserve.engine.config import EngineConfig
    from pdserve.node_runtime import memory_bounds
    from pdserve.node_runtime.node_config import NodeConfig

    monkeypatch.setattr(memory_bounds, "bound_shape_caches", lambda: None)  # leave this process's allocator
    handler = standin(users={USER: PASSWORD})
    with serving(handler) as server:
        discovery = DiscoveryConfig(
            discovery="nacos", nacos_server=server, nacos_username=USER, nacos_password="wrong-password"
        )
        node = FakeNode()
        code = node_common.serve(
            "decode", NodeConfig(engine=EngineConfig("unused"), discovery=discovery), lambda c: node
        )
    out, err = capsys.readouterr()
    assert code == 2 and "READY" not in out
    assert err.startswith("error: ") and "rejected the login of user 'pdserve' (HTTP 403)" in err
    assert "Traceback" not in err and "wrong-password" not in out + err
    assert node.stopped == [False]


async def test_https_server_certificate_is_verified(tmp_path, caplog, sdk_logs):
    pytest.importorskip("cryptography")
    from pdserve.node_runtime.cluster_tls import make_throwaway

    cert, key, ca = make_throwaway(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    handler = standin(users={USER: PASSWORD})
    with serving(handler, tls) as server:
        assert server.startswith("https://")
        node = NacosDiscovery(server, service="t", username=USER, password=PASSWORD, tls_ca=str(ca))
        router = NacosDiscovery(server, service="t", username=USER, password=PASSWORD, tls_ca=str(ca))
        try:
            await node.register(DECODE)
            await router.refresh()
            assert [m.port for m in router.members("decode")] == [50071]
        finally:
            await node.stop()
            await router.stop()
        assert [path for _, path, _ in handler.seen].count(LOGIN) == 2

        # the same server, trusted through the system's CAs only: its certificate does not verify, and
        # the password is never sent (2.0.x alone would have sent it, checking nothing)
        handler.seen.clear()
        untrusting = NacosDiscovery(server, service="t", username=USER, password=PASSWORD)
        with pytest.raises(DiscoveryError, match="cannot log in to nacos at https://") as failed:
            await untrusting.register(DECODE)
        assert not isinstance(failed.value, DiscoveryAuthError)
        assert handler.seen == []
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text  # the SDK's warning names the cause
        await untrusting.stop()

    # a plain-http client in the same process still gets the SDK's own behaviour
    plain = standin(users={USER: PASSWORD})
    with serving(plain) as server:
        node = NacosDiscovery(server, service="t", username=USER, password=PASSWORD)
        await node.register(DECODE)
        await node.stop()
        assert [path for _, path, _ in plain.seen][:2] == [LOGIN, "/nacos/v1/ns/instance"]


async def test_secrets_stay_out_of_logs_reprs_and_help(caplog, monkeypatch, sdk_logs):
    caplog.set_level(logging.DEBUG)
    handler = standin(users={USER: PASSWORD}, keys={ACCESS_KEY: SECRET_KEY})
    with serving(handler) as server:
        config = DiscoveryConfig(
            discovery="nacos",
            nacos_server=server,
            nacos_service="t",
            nacos_username=USER,
            nacos_password=PASSWORD,
            nacos_access_key=ACCESS_KEY,
            nacos_secret_key=SECRET_KEY,
        )
        node = discovery_from_config(config)
        assert isinstance(node, NacosDiscovery)
        node.heartbeat = 0.2
        router = discovery_from_config(config)
        try:
            await node.register(DECODE)
            await until(lambda: any(path.endswith("/beat") for _, path, _ in handler.seen), "an SDK heartbeat")
            await router.start()
            await until(lambda: all(t.done() for t in router._tasks), "the subscriptions")
        finally:
            await router.stop()
            await node.stop()
    sdk_lines = [r.getMessage() for r in caplog.records if r.name == "nacos.client"]
    # not vacuous: the SDK did log the login URL and the token, and they were scrubbed
    assert any(LOGIN in line and "password=***" in line for line in sdk_lines)
    assert any("AccessToken: ***" in line for line in sdk_lines)
    logged = caplog.text + "\n".join(sdk_lines)
    for secret in (PASSWORD, SECRET_KEY, "pa+ss%26w%C3%B6rd%3D1%25", *handler.tokens):
        assert secret not in logged
    assert handler.tokens and all(p.get("signature") for _, path, p in handler.seen if path != LOGIN)

    shown = repr(config) + str(config)
    assert PASSWORD not in shown and SECRET_KEY not in shown and USER in shown

    from pdserve.node_runtime.config import new_parser

    monkeypatch.setenv("PDSERVE_NACOS_PASSWORD", PASSWORD)
    monkeypatch.setenv("PDSERVE_NACOS_SECRET_KEY", SECRET_KEY)
    parser = new_parser(prog="pdserve").add_subparsers().add_parser("decode")  # a command's parser, as the CLI's
    add_discovery_args(parser)
    shown_help = io.StringIO()
    with contextlib.redirect_stdout(shown_help), pytest.raises(SystemExit):
        parser.parse_args(["--help"])  # as `pdserve decode --help` (configargparse adds env names when parsing)
    text = shown_help.getvalue()
    assert "PDSERVE_NACOS_PASSWORD" in text and PASSWORD not in text and SECRET_KEY not in text
    # the environment is how the secrets arrive (no `ps` exposure): the generic PDSERVE_<FLAG> mapping
    args = parser.parse_args(["--discovery", "nacos", "--nacos-username", USER, "--nacos-access-key", ACCESS_KEY])
    assert (args.nacos_password, args.nacos_secret_key) == (PASSWORD, SECRET_KEY)

    from pdserve.node_runtime.discovery import warn_secrets_in_argv

    caplog.clear()
    warn_secrets_in_argv(["pdserve", "router", f"--nacos-password={PASSWORD}", "--nacos-secret-key", SECRET_KEY])
    assert "--nacos-password puts a secret on the command line" in caplog.text
    assert "--nacos-secret-key puts a secret" in caplog.text and "$PDSERVE_NACOS_SECRET_KEY" in caplog.text
    assert PASSWORD not in caplog.text and SECRET_KEY not in caplog.text


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"nacos_username": USER}, "--nacos-username needs a password"),
        ({"nacos_password": PASSWORD}, "needs --nacos-username"),
        ({"nacos_access_key": ACCESS_KEY}, "--nacos-access-key needs a secret key"),
        ({"nacos_secret_key": SECRET_KEY}, "needs --nacos-access-key"),
        ({"nacos_tls_ca": "/etc/hostname"}, "--nacos-tls-ca needs an https:// --nacos-server"),
        ({"nacos_server": "https://nacos.example"}, "expected HOST"),
    ],
)
def test_half_given_settings_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag) as refused:
        DiscoveryConfig(discovery="nacos", **fields)
    assert PASSWORD not in str(refused.value) and SECRET_KEY not in str(refused.value)
    DiscoveryConfig(discovery="static", **fields)  # only a nacos process reads them


def test_secrets_from_files(tmp_path: Path):
    password_file, key_file, empty = tmp_path / "password", tmp_path / "sk", tmp_path / "empty"
    password_file.write_text(PASSWORD + "\n")
    key_file.write_text(SECRET_KEY)
    empty.write_text("\n")
    config = DiscoveryConfig(
        discovery="nacos",
        nacos_username=USER,
        nacos_password_file=str(password_file),
        nacos_access_key=ACCESS_KEY,
        nacos_secret_key_file=str(key_file),
    )
    assert (config.nacos_secret("password"), config.nacos_secret("secret_key")) == (PASSWORD, SECRET_KEY)
    with pytest.raises(ValueError, match="--nacos-password-file .* is empty"):
        DiscoveryConfig(discovery="nacos", nacos_username=USER, nacos_password_file=str(empty))
    with pytest.raises(ValueError, match="cannot read --nacos-secret-key-file"):
        DiscoveryConfig(discovery="nacos", nacos_access_key=ACCESS_KEY, nacos_secret_key_file=str(tmp_path / "no"))
    with pytest.raises(ValueError, match="not both"):
        DiscoveryConfig(
            discovery="nacos", nacos_username=USER, nacos_password="x", nacos_password_file=str(password_file)
        )
