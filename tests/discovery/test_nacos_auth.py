"""Nacos discovery against a Nacos that demands auth: the REAL nacos-sdk-python 2.0.x client (its login,
its access tokens, its request signing) talks to a local stand-in (tests/discovery/nacos_standin.py)
that checks credentials as Nacos does (tests/discovery/nacos_auth_standin.py). What is pinned:

- username/password: the SDK logs in with them, and every later request carries the token the
  server returned (never the password);
- access key/secret key: every naming request carries `ak`, `data` and `signature`, and the
  signature verifies under the secret key, computed here independently (base64 HMAC-SHA1 of
  `data`, which names the timestamp, group and service of that very request);
- a rejected login or signature ends in one DiscoveryAuthError that says so, for a node (register,
  and `pdserve prefill|decode`'s serve: exit 2, no READY) and for the router (start);
- https: the server's certificate is verified (the SDK alone would not check it), so the password
  never goes to a server the CA did not sign.

Secrets kept out of logs, reprs and --help, and half-given credentials: test_nacos_secrets.py.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import pytest

from pdserve.node_runtime.discovery import (
    DiscoveryAuthError,
    DiscoveryConfig,
    DiscoveryError,
)
from pdserve.node_runtime.discovery.nacos import NacosDiscovery
from tests.discovery.nacos_auth_standin import (
    ACCESS_KEY,
    DECODE,
    independent_signature,
    LOGIN,
    PASSWORD,
    SECRET_KEY,
    serving,
    standin,
    until,
    USER,
)


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
