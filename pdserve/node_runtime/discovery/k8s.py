"""Kubernetes discovery: one member per pod behind a headless Service, from cluster DNS.

Two forms of the service spec:
- `NAME:PORT`: the A records of NAME, each with the given port.
- `_PORTNAME._tcp.NAME` (or `NAME` alone, meaning `_grpc._tcp.NAME`): the SRV records
  Kubernetes publishes for a named Service port, so the port comes from the Service and
  a port change needs no router flag change. Each SRV target is resolved to its address.

Not exercised against a real cluster here (no Kubernetes API server or cluster DNS on
these machines). The SRV path is tested against a real DNS server (dnsmasq in a private
network namespace) through dnspython and the system resolver configuration.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

from pdserve.node_runtime.discovery.base import Discovery, Member

log = logging.getLogger("pdserve.discovery")
Resolver = Callable[[str], list[str]]
SrvResolver = Callable[[str], list[tuple[str, int]]]


def dns_resolver(name: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})


def srv_resolver(name: str) -> list[tuple[str, int]]:
    """(address, port) of every SRV record of `name`, targets resolved through the system resolver.

    dnspython reads /etc/resolv.conf (search domains included, as cluster DNS needs); its
    errors are turned into OSError so the caller's keep-last-known path handles them.
    """
    import dns.exception
    import dns.resolver

    try:
        answer = dns.resolver.resolve(name, "SRV", search=True)
    except dns.resolver.NoAnswer:
        return []
    except dns.exception.DNSException as e:
        raise OSError(f"SRV lookup of {name} failed: {e}") from None
    return sorted({(ip, rr.port) for rr in answer for ip in dns_resolver(rr.target.to_text())})


def srv_name(spec: str) -> str | None:
    """The SRV name a spec asks for, or None for the `NAME:PORT` form."""
    if spec.startswith("_"):
        return spec
    return None if ":" in spec else f"_grpc._tcp.{spec}"


class K8sDnsDiscovery(Discovery):
    """Resolves `NAME:PORT` per role every `interval` seconds; keeps the last view on failure."""

    def __init__(
        self,
        services: dict[str, str],
        interval: float = 5.0,
        resolver: Resolver = dns_resolver,
        srv: SrvResolver = srv_resolver,
    ) -> None:
        self.services = {role: spec for role, spec in services.items() if spec}
        self.interval = interval
        self.resolver = resolver
        self.srv = srv
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
            try:
                self._members[role] = [
                    Member(role, ip, port) for ip, port in await loop.run_in_executor(None, self._lookup, spec)
                ]
            except OSError as e:
                log.warning(
                    "k8s discovery: cannot resolve %s (%s); keeping %d known %s nodes",
                    spec,
                    e,
                    len(self._members.get(role, [])),
                    role,
                )

    def _lookup(self, spec: str) -> list[tuple[str, int]]:
        srv = srv_name(spec)
        if srv is not None:
            return self.srv(srv)
        name, _, port = spec.rpartition(":")
        return [(ip, int(port)) for ip in self.resolver(name)]

    def members(self, role: str) -> list[Member]:
        return list(self._members.get(role, []))
