"""Kubernetes discovery: one member per A record of a headless Service.

Not exercised against a real cluster here (no Kubernetes API server or cluster
DNS on these machines); the resolver is injectable and tested with a fake.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

from pdserve.discovery.base import Discovery, Member

log = logging.getLogger("pdserve.discovery")
Resolver = Callable[[str], list[str]]


def dns_resolver(name: str) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})


class K8sDnsDiscovery(Discovery):
    """Resolves `NAME:PORT` per role every `interval` seconds; keeps the last view on failure."""

    def __init__(self, services: dict[str, str], interval: float = 5.0, resolver: Resolver = dns_resolver) -> None:
        self.services = {role: spec for role, spec in services.items() if spec}
        self.interval = interval
        self.resolver = resolver
        self._members: dict[str, list[Member]] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()

    async def refresh(self) -> None:
        loop = asyncio.get_running_loop()
        for role, spec in self.services.items():
            name, _, port = spec.rpartition(":")
            try:
                ips = await loop.run_in_executor(None, self.resolver, name)
            except OSError as e:
                log.warning("k8s discovery: cannot resolve %s (%s); keeping %d known %s nodes",
                            name, e, len(self._members.get(role, [])), role)
                continue
            self._members[role] = [Member(role, ip, int(port)) for ip in ips]

    def members(self, role: str) -> list[Member]:
        return list(self._members.get(role, []))
