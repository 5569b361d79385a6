"""Service discovery behind one small interface: static | nacos | k8s (headless-Service DNS)."""

from __future__ import annotations

import argparse

from pdserve.discovery.base import Discovery, Member
from pdserve.discovery.static import StaticDiscovery


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery", default="static", choices=["static", "nacos", "k8s"])
    p.add_argument("--prefill", default="", help="static: comma-separated prefill HOST:PORT list")
    p.add_argument("--decode", default="", help="static: comma-separated decode HOST:PORT list")
    p.add_argument("--nacos-server", default="127.0.0.1:8848", help="nacos: server HOST:PORT")
    p.add_argument("--nacos-namespace", default="", help="nacos: namespace id")
    p.add_argument("--nacos-service", default="pdserve", help="nacos: service name prefix")
    p.add_argument("--k8s-prefill-service", default="", help="k8s: headless service of prefill nodes: NAME:PORT (A records) or NAME / "
                        "_PORTNAME._tcp.NAME (SRV records: port from the Service)")
    p.add_argument("--k8s-decode-service", default="", help="k8s: headless service of decode nodes (same forms as --k8s-prefill-service)")


def discovery_from_args(args: argparse.Namespace) -> Discovery:
    if args.discovery == "nacos":
        from pdserve.discovery.nacos import NacosDiscovery
        return NacosDiscovery(args.nacos_server, args.nacos_namespace, args.nacos_service)
    if args.discovery == "k8s":
        from pdserve.discovery.k8s import K8sDnsDiscovery
        return K8sDnsDiscovery({"prefill": args.k8s_prefill_service, "decode": args.k8s_decode_service})
    return StaticDiscovery.from_lists(args.prefill, args.decode)


__all__ = ["Discovery", "Member", "StaticDiscovery", "add_discovery_args", "discovery_from_args"]
