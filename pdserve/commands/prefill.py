"""`pdserve prefill`: run a prefill node."""

from __future__ import annotations

import argparse

from pdserve.commands.node_common import add_node_args, node_config, serve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill node (gRPC Prefill service)")
    add_node_args(p, "prefill")
    p.add_argument(
        "--cachestore-port",
        type=int,
        default=None,
        help="CacheStore listener port for D->P pulls (decode nodes write held prefix blocks here; 0: pick a free one)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.prefill_node import PrefillNode

    return serve("prefill", node_config(args, "prefill"), PrefillNode)
