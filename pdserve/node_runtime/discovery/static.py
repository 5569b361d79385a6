"""Static membership from flags."""

from __future__ import annotations

from pdserve.node_runtime.discovery.base import Discovery, Member


class StaticDiscovery(Discovery):
    """A fixed list of nodes (flags or config); health checks decide which are usable."""

    def __init__(self, members: list[Member]) -> None:
        self._members = list(members)

    @classmethod
    def from_lists(cls, prefill: str, decode: str) -> "StaticDiscovery":
        members = [Member.parse("prefill", a) for a in prefill.split(",") if a.strip()]
        members += [Member.parse("decode", a) for a in decode.split(",") if a.strip()]
        return cls(members)

    def members(self, role: str) -> list[Member]:
        return [m for m in self._members if m.role == role]
