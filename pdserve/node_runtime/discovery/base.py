"""The discovery interface: who the prefill and decode nodes are."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


class DiscoveryError(RuntimeError):
    """A registry call failed in a way the operator must read (its message says why, with no secrets):
    a node that cannot register exits with it instead of a traceback."""


class DiscoveryAuthError(DiscoveryError):
    """The registry rejected our credentials (or refused them the access they need): retrying cannot
    help, so a process stops at start with this message rather than serving an empty cluster."""


class Role(enum.StrEnum):
    """A serving node's role in the cluster (members equal their strings: discovery metadata and
    logs carry the plain name)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Member:
    """One node: its role, gRPC address and metadata (cachestore_port, metrics_port, node_id)."""

    role: str
    host: str
    port: int
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, role: str, address: str) -> "Member":
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad {role} address {address!r}: expected HOST:PORT")
        return cls(role, host, int(port))


class Discovery(ABC):
    """Membership of the cluster. `members()` always answers from the last known view, so a
    registry outage does not empty the cluster."""

    async def check(self) -> None:
        """Fail fast with DiscoveryAuthError on what retrying cannot fix (rejected credentials), before
        a process starts serving; a registry that is merely down is not an error here."""

    async def start(self) -> None:
        """Begin watching (subscribe or refresh)."""

    async def stop(self) -> None:
        """Stop watching."""

    async def register(self, member: Member) -> None:
        """Announce a node (a no-op where the platform does it, e.g. static, k8s)."""

    async def deregister(self, member: Member) -> None:
        """Withdraw a node."""

    @abstractmethod
    def members(self, role: str) -> list[Member]:
        """Last known nodes of `role`."""
