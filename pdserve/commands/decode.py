"""`pdserve decode`: run a decode node."""

from __future__ import annotations

import argparse

from pdserve.commands.node_common import add_decode_kv_args, add_node_args, node_config, serve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode", help="run a decode node (gRPC Decode service + CacheStore receiver)")
    add_node_args(p, "decode")
    p.add_argument("--cachestore-port", type=int, default=None, help="CacheStore listener port (0: pick a free one)")
    p.add_argument(
        "--colocated",
        action="store_true",
        default=None,
        help="accepted for compatibility: a decode node always prefills a request that names no prefill node",
    )
    add_decode_kv_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.decode_node import DecodeNode

    return serve("decode", node_config(args, "decode"), DecodeNode)
