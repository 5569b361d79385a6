"""Nacos discovery with nacos-sdk-python 2.0.x (the HTTP open API, /nacos/v1/ns/...).

Why 2.0.x and not 3.x: 3.x speaks only Nacos's gRPC protocol and installs a
top-level package named `v2`, which can clash with other code; 2.0.x's
`nacos.NacosClient` uses the plain HTTP naming API that Nacos 1.x/2.x servers
serve (and 3.x keeps behind its compatibility switch), which a small local
stand-in can implement faithfully for tests. No Nacos server runs on these
machines: the tests use such a stand-in, not a real server.

Nodes register as ephemeral instances of `<service>-<role>` with their ports
as metadata. Heartbeats are the SDK's own (`add_naming_instance(...,
heartbeat_interval=)`): its beat carries the full metadata, so when the server
has expired an instance (about 30 s without beats) and a beat re-creates it, no
metadata is lost. The router lists healthy instances every few seconds and
keeps the last-known membership while the registry is unreachable. It polls
instead of using the SDK's `subscribe`, because 2.0.x's subscribe never
notifies the instances it sees on its first poll (a lone node present at
start-up would stay unknown).
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.discovery.base import ROLES, Discovery, Member

log = logging.getLogger("pdserve.discovery")


class NacosDiscovery(Discovery):
    """Registers members (nodes) and watches members (router) through a Nacos server."""

    def __init__(self, server: str, namespace: str = "", service: str = "pdserve", interval: float = 3.0,
                 heartbeat: float = 5.0) -> None:
        import nacos  # nacos-sdk-python 2.0.x

        self.client = nacos.NacosClient(server, namespace=namespace or None)
        self.service = service
        self.interval = interval
        self.heartbeat = heartbeat
        self._members: dict[str, list[Member]] = {}
        self._registered: list[Member] = []
        self._tasks: list[asyncio.Task] = []

    def service_name(self, role: str) -> str:
        return f"{self.service}-{role}"

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._watch()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for member in list(self._registered):
            await self.deregister(member)

    async def register(self, member: Member) -> None:
        meta = {"role": member.role, **{k: str(v) for k, v in member.metadata.items()}}
        await self._call(self.client.add_naming_instance, self.service_name(member.role), member.host, member.port,
                         metadata=meta, ephemeral=True, heartbeat_interval=self.heartbeat)
        self._registered.append(member)

    async def deregister(self, member: Member) -> None:
        try:
            await self._call(self.client.remove_naming_instance, self.service_name(member.role), member.host,
                             member.port, ephemeral=True)
        except Exception as e:  # the registry may be gone at shutdown; the instance then expires
            log.warning("nacos deregister of %s failed: %s", member.address, e)
            # The SDK stops its beat thread only after a successful removal; stop it here too
            # (its task table is keyed "service#ip#port" in 2.0.x).
            task = self.client.heartbeats.pop(f"{self.service_name(member.role)}#{member.host}#{member.port}", None)
            if task is not None:
                task.stop()
        if member in self._registered:
            self._registered.remove(member)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()

    async def refresh(self) -> None:
        for role in ROLES:
            try:
                reply = await self._call(self.client.list_naming_instance, self.service_name(role), healthy_only=True)
            except Exception as e:
                log.warning("nacos unreachable (%s); keeping %d known %s nodes", e,
                            len(self._members.get(role, [])), role)
                continue
            hosts = reply.get("hosts", []) if isinstance(reply, dict) else []
            self._members[role] = [Member(role, h["ip"], int(h["port"]), dict(h.get("metadata") or {}))
                                   for h in hosts if h.get("enabled", True)]

    def members(self, role: str) -> list[Member]:
        return list(self._members.get(role, []))
