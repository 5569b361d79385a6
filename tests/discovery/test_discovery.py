"""Discovery backends. The nacos test drives the REAL nacos-sdk-python 2.0.x client against a small
local stand-in of the Nacos v1 HTTP naming API (no Nacos server can run on these machines)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from pdserve.discovery import Member, StaticDiscovery
from pdserve.discovery.k8s import K8sDnsDiscovery


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
    """Implements the v1 naming endpoints nacos.NacosClient (2.0.x) calls, in memory."""

    instances: dict[str, dict[tuple[str, int], dict]] = {}
    beats: list[str] = []

    def _params(self) -> dict[str, str]:
        q = parse_qs(urlparse(self.path).query)
        length = int(self.headers.get("content-length") or 0)
        if length:
            q.update(parse_qs(self.rfile.read(length).decode()))
        return {k: v[0] for k, v in q.items()}

    def _reply(self, body, status: int = 200) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _service(self, p: dict) -> str:
        return p["serviceName"].split("@@")[-1]

    def do_POST(self) -> None:
        p = self._params()
        if urlparse(self.path).path == "/nacos/v1/ns/instance":
            meta = json.loads(p.get("metadata") or "{}")
            self.instances.setdefault(self._service(p), {})[(p["ip"], int(p["port"]))] = meta
            return self._reply("ok")
        self._reply("not found", 404)

    def do_DELETE(self) -> None:
        p = self._params()
        self.instances.get(self._service(p), {}).pop((p["ip"], int(p["port"])), None)
        self._reply("ok")

    def do_PUT(self) -> None:
        p = self._params()
        self.beats.append(self._service(p))
        self._reply({"clientBeatInterval": 5000, "code": 10200})

    def do_GET(self) -> None:
        p = self._params()
        hosts = [{"ip": ip, "port": port, "metadata": meta, "enabled": True, "healthy": True, "weight": 1.0}
                 for (ip, port), meta in self.instances.get(self._service(p), {}).items()]
        self._reply({"name": p["serviceName"], "hosts": hosts, "cacheMillis": 3000})

    def log_message(self, *args) -> None:
        pass


async def test_nacos_register_list_and_outage():
    from pdserve.discovery.nacos import NacosDiscovery
    NacosStandIn.instances = {}
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
    finally:
        httpd.server_close()
