"""Discovery backends. The nacos test drives the REAL nacos-sdk-python 2.0.x client against a small
local stand-in of the Nacos v1 HTTP naming API (no Nacos server can run on these machines)."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from pdserve.node_runtime.discovery import Member, StaticDiscovery
from pdserve.node_runtime.discovery.k8s import K8sDnsDiscovery
from tests.discovery.nacos_standin import NacosStandIn


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
