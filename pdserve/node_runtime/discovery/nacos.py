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
metadata is lost. The router watches with the SDK's own `subscribe` (healthy
instances only) and applies its ADDED / MODIFIED / DELETED events. Two 2.0.x
quirks are handled here: its first poll notifies nothing (so `start` lists once
itself, and later ADDED events for known instances are idempotent), and its
poll timer stops for good on the first failed poll (so we mark the timer to
ignore errors: a registry outage keeps the last-known membership and the
subscription resumes afterwards). A node that dies between the SDK's first and
second poll raises no event; the router's own health checks cover that case.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from pdserve.node_runtime.discovery.base import ROLES, Discovery, Member

log = logging.getLogger("pdserve.discovery")


def _instance_id(host: dict) -> str:
    """Nacos's id of an instance (the key of the SDK's events), derived as Nacos does when absent."""
    return host.get("instanceId") or f"{host['ip']}#{host['port']}"


def _member(role: str, host: dict) -> Member:
    return Member(role, host["ip"], int(host["port"]), dict(host.get("metadata") or {}))


class NacosDiscovery(Discovery):
    """Registers members (nodes) and watches members (router) through a Nacos server."""

    def __init__(
        self, server: str, namespace: str = "", service: str = "pdserve", interval: float = 3.0, heartbeat: float = 5.0
    ) -> None:
        import nacos  # nacos-sdk-python 2.0.x

        self.client = nacos.NacosClient(server, namespace=namespace or None)
        self.service = service
        self.interval = interval
        self.heartbeat = heartbeat
        self._lock = threading.Lock()  # subscription events arrive on the SDK's timer threads
        self._members: dict[str, dict[str, Member]] = {}  # role -> instance id -> member
        self._registered: list[Member] = []
        self._tasks: list[asyncio.Task] = []

    def service_name(self, role: str) -> str:
        return f"{self.service}-{role}"

    def instance(self, member: Member) -> tuple[str, str, int]:
        """(service name, ip, port): what Nacos identifies a registered instance by."""
        return self.service_name(member.role), member.host, member.port

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._subscribe_all()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.client.stop_subscribe()
        for member in list(self._registered):
            await self.deregister(member)

    async def register(self, member: Member) -> None:
        meta = {"role": member.role, **{k: str(v) for k, v in member.metadata.items()}}
        await self._call(
            self.client.add_naming_instance,
            *self.instance(member),
            metadata=meta,
            ephemeral=True,
            heartbeat_interval=self.heartbeat,
        )
        self._registered.append(member)

    async def deregister(self, member: Member) -> None:
        try:
            await self._call(self.client.remove_naming_instance, *self.instance(member), ephemeral=True)
        except Exception as e:  # the registry may be gone at shutdown; the instance then expires
            log.warning("nacos deregister of %s failed: %s", member.address, e)
            # The SDK stops its beat thread only after a successful removal; stop it here too
            # (its task table is keyed "service#ip#port" in 2.0.x).
            task = self.client.heartbeats.pop("#".join(map(str, self.instance(member))), None)
            if task is not None:
                task.stop()
        if member in self._registered:
            self._registered.remove(member)

    async def _subscribe_all(self) -> None:
        """Subscribe to each role; a registry down now is retried (subscribe's first poll is synchronous)."""
        from nacos.listener import SubscribeListener

        pending = list(ROLES)
        while pending:
            role, name = pending[0], self.service_name(pending[0])
            listener = SubscribeListener(lambda event, slc, role=role: self._on_event(role, event, slc), "pdserve")
            try:
                await self._call(self.client.subscribe, listener, self.interval, name, healthy_only=True)
            except Exception as e:
                log.warning("nacos subscribe to %s failed (%s); retrying", name, e)
                await asyncio.sleep(self.interval)
                continue
            timer = self.client.subscribe_timer_manager.all_timers().get(f"service-subscribe-timer-{name}")
            if timer is not None:
                timer.set_ignore_ex(True)
            pending.pop(0)

    def _on_event(self, role: str, event: str, slc) -> None:
        with self._lock:
            known = self._members.setdefault(role, {})
            if event == "DELETED" or not slc.instance.get("enabled", True):
                known.pop(slc.instance_id, None)
            else:
                known[slc.instance_id] = _member(role, slc.instance)

    async def refresh(self) -> None:
        """One full healthy listing per role (at start; the subscription keeps it current after)."""
        for role in ROLES:
            try:
                reply = await self._call(self.client.list_naming_instance, self.service_name(role), healthy_only=True)
            except Exception as e:
                log.warning(
                    "nacos unreachable (%s); keeping %d known %s nodes", e, len(self._members.get(role, {})), role
                )
                continue
            hosts = reply.get("hosts", []) if isinstance(reply, dict) else []
            with self._lock:
                self._members[role] = {_instance_id(h): _member(role, h) for h in hosts if h.get("enabled", True)}

    def members(self, role: str) -> list[Member]:
        with self._lock:
            return sorted(self._members.get(role, {}).values(), key=lambda m: (m.host, m.port))
