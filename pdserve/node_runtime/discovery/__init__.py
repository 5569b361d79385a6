"""Service discovery behind one small interface: static | nacos | k8s (headless-Service DNS)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.node_runtime.discovery.base import Discovery, Member
from pdserve.node_runtime.discovery.static import StaticDiscovery

KINDS = ("static", "nacos", "k8s")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How a process finds (router) or announces (nodes) cluster members."""

    discovery: str = "static"
    """One of KINDS."""
    prefill: str = ""
    """static: comma-separated prefill HOST:PORT list."""
    decode: str = ""
    """static: comma-separated decode HOST:PORT list."""
    nacos_server: str = "127.0.0.1:8848"
    nacos_namespace: str = ""
    nacos_service: str = "pdserve"
    """nacos: service name prefix."""
    k8s_prefill_service: str = ""
    """k8s: headless service of prefill nodes (NAME:PORT, NAME or _PORTNAME._tcp.NAME)."""
    k8s_decode_service: str = ""

    def __post_init__(self) -> None:
        if self.discovery not in KINDS:
            raise ValueError(f"discovery must be one of {', '.join(KINDS)}, got {self.discovery!r}")


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    """The DiscoveryConfig flags, one per field; unset flags are None (the field's default applies)."""
    p.add_argument("--discovery", default=None, choices=KINDS, help="membership source (default static)")
    p.add_argument("--prefill", default=None, help="static: comma-separated prefill HOST:PORT list")
    p.add_argument("--decode", default=None, help="static: comma-separated decode HOST:PORT list")
    p.add_argument("--nacos-server", default=None, help="nacos: server HOST:PORT (default 127.0.0.1:8848)")
    p.add_argument("--nacos-namespace", default=None, help="nacos: namespace id")
    p.add_argument("--nacos-service", default=None, help="nacos: service name prefix (default pdserve)")
    p.add_argument(
        "--k8s-prefill-service",
        default=None,
        help="k8s: headless service of prefill nodes: NAME:PORT (A records) or NAME / "
        "_PORTNAME._tcp.NAME (SRV records: port from the Service)",
    )
    p.add_argument(
        "--k8s-decode-service",
        default=None,
        help="k8s: headless service of decode nodes (same forms as --k8s-prefill-service)",
    )


def discovery_from_config(config: DiscoveryConfig) -> Discovery:
    if config.discovery == "nacos":
        from pdserve.node_runtime.discovery.nacos import NacosDiscovery

        return NacosDiscovery(config.nacos_server, config.nacos_namespace, config.nacos_service)
    if config.discovery == "k8s":
        from pdserve.node_runtime.discovery.k8s import K8sDnsDiscovery

        return K8sDnsDiscovery({"prefill": config.k8s_prefill_service, "decode": config.k8s_decode_service})
    return StaticDiscovery.from_lists(config.prefill, config.decode)


__all__ = ["Discovery", "DiscoveryConfig", "Member", "StaticDiscovery", "add_discovery_args", "discovery_from_config"]
