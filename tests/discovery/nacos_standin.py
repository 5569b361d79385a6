"""A small local stand-in of the Nacos v1 HTTP naming API that nacos-sdk-python 2.0.x calls (no Nacos
server can run on these machines), shared by the discovery tests."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse


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
