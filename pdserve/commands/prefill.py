"""`pdserve prefill`: run a prefill node."""

from __future__ import annotations

import argparse

from pdserve.commands.config_flags import config_flag
from pdserve.commands.node_common import add_node_args, node_config, serve
from pdserve.node_runtime.node_config import TransferOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill node (gRPC Prefill service)")
    add_node_args(p, "prefill")
    config_flag(p, TransferOptions, "cachestore_port")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.prefill_node import PrefillNode

    return serve("prefill", node_config(args, "prefill"), PrefillNode)
