"""Discovery backends. The nacos test drives the REAL nacos-sdk-python 2.0.x client against a small
local stand-in of the Nacos v1 HTTP naming API (no Nacos server can run on these machines)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from pdserve.node_runtime.discovery import Member, StaticDiscovery
from pdserve.node_runtime.discovery.k8s import K8sDnsDiscovery


def test_static_parses_flags_and_rejects_garbage():
    d = StaticDiscovery.from_lists("127.0.0.1:1,127.0.0.1:2", "127.0.0.1:3")
    assert [m.address for m in d.members("prefill")] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert [m.port for m in d.members("decode")] == [3]
    with pytest.raises(ValueError, match="HOST:PORT"):
        StaticDiscovery.from_lists("nonsense", "")


async def test_k8s_dns_keeps_last_known_on_failure():
    answers = {"decode-headless": ["10.0.0.2", "10.0.0.1"]}

    def resolver(name: str) -> list[str]:
        if name not in answers:
            raise OSError("NXDOMAIN")
        return sorted(answers[name])

    d = K8sDnsDiscovery({"decode": "decode-headless:50071", "prefill": "prefill-headless:50061"}, resolver=resolver)
    await d.refresh()
    assert [m.address for m in d.members("decode")] == ["10.0.0.1:50071", "10.0.0.2:50071"]
    assert d.members("prefill") == []
    answers.pop("decode-headless")  # DNS outage
    await d.refresh()
    assert len(d.members("decode")) == 2


class NacosStandIn(BaseHTTPRequestHandler):
    """The v1 naming endpoints nacos.NacosClient (2.0.x) calls, in memory, with Nacos's expiry of
    ephemeral instances: unhealthy after `unhealthy_after` s without a beat (Nacos: 15 s), deleted
    after `delete_after` s (Nacos: 30 s); a beat for an unknown instance re-creates it from the
    beat's own metadata, as Nacos does. Intervals are class attributes so tests need not wait 30 s.
    A stand-in, not a Nacos server (none can be installed here)."""

    unhealthy_after = 15.0
    delete_after = 30.0
    instances: dict[str, dict[tuple[str, int], dict]] = {}
    last_beat: dict[tuple[str, str, int], float] = {}
    beats: list[str] = []
    down = False  # True: listing answers 503 (a registry outage as the router's subscription sees it)

    def _params(self) -> dict[str, str]:
        q = parse_qs(urlparse(self.path).query)
        length = int(self.headers.get("content-length") or 0)
        if length:
            q.update(parse_qs(self.rfile.read(length).decode()))
        return {k: v[0] for k, v in q.items()}

    def _reply(self, body, status: int = 200) -> None:
        data = (
            body
            if isinstance(body, bytes)
            else json.dumps(body).encode()
            if not isinstance(body, str)
            else body.encode()
        )
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _service(self, p: dict) -> str:
        return p["serviceName"].split("@@")[-1]

    def _expire(self) -> None:
        now = time.monotonic()
        for service, hosts in self.instances.items():
            for key in [k for k in hosts if now - self.last_beat.get((service, *k), now) > self.delete_after]:
                del hosts[key]

    def _put(self, service: str, ip: str, port: int, meta: dict) -> None:
        self.instances.setdefault(service, {})[(ip, port)] = meta
        self.last_beat[(service, ip, port)] = time.monotonic()

    def do_POST(self) -> None:
        p = self._params()
        if urlparse(self.path).path == "/nacos/v1/ns/instance":
            self._put(self._service(p), p["ip"], int(p["port"]), json.loads(p.get("metadata") or "{}"))
            return self._reply("ok")
        self._reply("not found", 404)

    def do_DELETE(self) -> None:
        p = self._params()
        self.instances.get(self._service(p), {}).pop((p["ip"], int(p["port"])), None)
        self._reply("ok")

    def do_PUT(self) -> None:
        p = self._params()
        self._expire()
        service, beat = self._service(p), json.loads(p.get("beat") or "{}")
        key = (beat.get("ip", p.get("ip")), int(beat.get("port", p.get("port"))))
        self.beats.append(service)
        if key not in self.instances.get(service, {}):  # expired: the beat re-registers it, metadata from the beat
            self._put(service, *key, dict(beat.get("metadata") or {}))
        self.last_beat[(service, *key)] = time.monotonic()
        self._reply({"clientBeatInterval": 5000, "code": 10200})

    def do_GET(self) -> None:
        if self.down:
            return self._reply("server is down", 503)
        p = self._params()
        self._expire()
        service, now = self._service(p), time.monotonic()
        hosts = [
            {
                "instanceId": f"{ip}#{port}#DEFAULT#DEFAULT_GROUP@@{service}",
                "ip": ip,
                "port": port,
                "metadata": meta,
                "enabled": True,
                "weight": 1.0,
                "healthy": now - self.last_beat.get((service, ip, port), now) <= self.unhealthy_after,
            }
            for (ip, port), meta in self.instances.get(service, {}).items()
        ]
        if p.get("healthyOnly", "false").lower() == "true":
            hosts = [h for h in hosts if h["healthy"]]
        self._reply({"name": p["serviceName"], "hosts": hosts, "cacheMillis": 3000})

    def log_message(self, *args) -> None:
        pass


async def test_nacos_register_list_and_outage():
    from pdserve.node_runtime.discovery.nacos import NacosDiscovery

    NacosStandIn.instances, NacosStandIn.last_beat = {}, {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NacosStandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = f"127.0.0.1:{httpd.server_address[1]}"
        node = NacosDiscovery(server, service="t")
        await node.register(Member("decode", "127.0.0.1", 50071, {"cachestore_port": 50081}))
        await node.register(Member("prefill", "127.0.0.1", 50061))
        router = NacosDiscovery(server, service="t")
        await router.refresh()
        decodes = router.members("decode")
        assert [m.address for m in decodes] == ["127.0.0.1:50071"]
        assert decodes[0].metadata["cachestore_port"] == "50081" and decodes[0].metadata["role"] == "decode"
        assert [m.address for m in router.members("prefill")] == ["127.0.0.1:50061"]
        httpd.shutdown()  # registry outage: the router keeps the last known membership
        httpd.server_close()
        await router.refresh()
        assert len(router.members("decode")) == 1
        await node.stop()  # deregistering against a dead registry still stops the SDK's beat threads
        assert not node.client.heartbeats
    finally:
        httpd.server_close()


async def test_nacos_expiry_and_sdk_heartbeat_keep_metadata(monkeypatch):
    """An instance without beats turns unhealthy, then is deleted; the SDK's beat re-creates it with
    all its metadata (our old hand-rolled beat sent only the role)."""
    from pdserve.node_runtime.discovery.nacos import NacosDiscovery

    monkeypatch.setattr(NacosStandIn, "unhealthy_after", 0.6)
    monkeypatch.setattr(NacosStandIn, "delete_after", 1.2)
    NacosStandIn.instances, NacosStandIn.last_beat = {}, {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NacosStandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = f"127.0.0.1:{httpd.server_address[1]}"
        silent = NacosDiscovery(server, service="x", heartbeat=3600)  # registers, then never beats again
        await silent.register(Member("decode", "127.0.0.1", 50072, {"cachestore_port": 50082}))
        router = NacosDiscovery(server, service="x")
        await router.refresh()
        assert [m.port for m in router.members("decode")] == [50072]
        deadline = time.monotonic() + 30
        while router.members("decode") and time.monotonic() < deadline:  # healthy-only list: gone when unhealthy
            await asyncio.sleep(0.2)
            await router.refresh()  # the stand-in expires lazily, on each request (clients see no difference)
        assert router.members("decode") == []
        while NacosStandIn.instances["x-decode"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await router.refresh()
        assert not NacosStandIn.instances["x-decode"], "an instance without beats must be deleted"

        beating = NacosDiscovery(server, service="x", heartbeat=0.2)
        await beating.register(Member("decode", "127.0.0.1", 50073, {"cachestore_port": 50083}))
        NacosStandIn.instances["x-decode"].clear()  # the server lost it (e.g. a restart): the next beat restores it
        deadline = time.monotonic() + 30
        while not NacosStandIn.instances["x-decode"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # past delete_after: still there, because it beats
        await router.refresh()
        (member,) = router.members("decode")
        assert member.port == 50073 and member.metadata["cachestore_port"] == "50083"
        assert member.metadata["role"] == "decode"
        await beating.stop()
        await silent.stop()
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_nacos_subscription_follows_changes_and_survives_an_outage(monkeypatch):
    """The router's view follows the SDK's subscribe events (no refresh() calls here): a node that
    joins appears, a node that stops beating disappears, and an outage neither empties the view
    nor ends the subscription (2.0.x's poll timer stops on the first error unless told otherwise)."""
    from pdserve.node_runtime.discovery.nacos import NacosDiscovery

    monkeypatch.setattr(NacosStandIn, "unhealthy_after", 2.0)
    monkeypatch.setattr(NacosStandIn, "delete_after", 4.0)
    NacosStandIn.instances, NacosStandIn.last_beat, NacosStandIn.down = {}, {}, False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NacosStandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = f"127.0.0.1:{httpd.server_address[1]}"
    first = NacosDiscovery(server, service="s", heartbeat=0.2)
    later = NacosDiscovery(server, service="s", heartbeat=0.2)
    router = NacosDiscovery(server, service="s", interval=0.2)

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)

    def ports() -> list[int]:
        return [m.port for m in router.members("decode")]

    try:
        await first.register(Member("decode", "127.0.0.1", 50071, {"cachestore_port": 50081}))
        await router.start()
        assert ports() == [50071]
        await until(lambda: all(t.done() for t in router._tasks), "both roles subscribed")
        await later.register(Member("decode", "127.0.0.1", 50072, {"cachestore_port": 50082}))
        await until(lambda: ports() == [50071, 50072], "the joining node")
        assert router.members("decode")[1].metadata["cachestore_port"] == "50082"

        NacosStandIn.down = True
        await asyncio.sleep(1.0)  # several failed polls
        assert ports() == [50071, 50072]
        NacosStandIn.down = False
        for task in list(later.client.heartbeats.values()):  # `later` dies without deregistering
            task.stop()
        await until(lambda: ports() == [50071], "the silent node to drop out after the outage")
    finally:
        NacosStandIn.down = False
        await router.stop()
        await first.stop()
        await later.stop()
        httpd.shutdown()
        httpd.server_close()
