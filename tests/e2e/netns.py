"""A real network partition for e2e tests: two network namespaces joined by a veth pair.

`with Partitionable() as net:` creates namespaces A and B (names unique to this process), links
them with a veth pair on a private /30 that exists only inside them, and deletes both on exit
(which also deletes the veth pair). `net.cut()` sets A's end of the link down: B's packets to A
are dropped silently (no FIN, no RST), which is what a partitioned host looks like from B.
Needs root and `ip netns`; `available()` says why not otherwise, for a skip."""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = ("10.213.7.1", "10.213.7.2")
"""A's and B's address: a private /30 that is routed nowhere outside the two namespaces."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pdprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', b'') or e}"
    _ip("netns", "del", probe)
    return None


class Partitionable:
    """Namespaces `a` and `b` joined by a veth pair; `prefix(ns)` runs a command inside one."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.a, self.b = f"pdpa{tag}", f"pdpb{tag}"
        self.veth_a, self.veth_b = f"vpa{tag}", f"vpb{tag}"
        self.addr_a, self.addr_b = SUBNET

    def __enter__(self) -> "Partitionable":
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip(
                "link",
                "add",
                self.veth_a,
                "netns",
                self.a,
                "type",
                "veth",
                "peer",
                "name",
                self.veth_b,
                "netns",
                self.b,
            )
            for ns, dev, addr in ((self.a, self.veth_a, self.addr_a), (self.b, self.veth_b, self.addr_b)):
                _ip("addr", "add", f"{addr}/30", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def cut(self) -> None:
        """A's end down: B keeps its route and its sockets, and its packets vanish."""
        _ip("link", "set", self.veth_a, "down", ns=self.a)

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
