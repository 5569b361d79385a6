"""`pdserve decode`: run a decode node."""

from __future__ import annotations

import argparse

from pdserve.commands.config_flags import config_flag
from pdserve.commands.node_common import add_decode_kv_args, add_node_args, node_config, serve
from pdserve.node_runtime.node_config import NodeOptions, TransferOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode", help="run a decode node (gRPC Decode service + CacheStore receiver)")
    add_node_args(p, "decode")
    config_flag(p, TransferOptions, "cachestore_port")
    config_flag(p, NodeOptions, "colocated", action="store_true")
    add_decode_kv_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.decode_node import DecodeNode

    return serve("decode", node_config(args, "decode"), DecodeNode)
