"""`pdserve decode`: run a decode node."""

from __future__ import annotations

import argparse

from pdserve.commands.node_common import add_node_args, node_config, serve


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
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=None,
        help="with --kv-reuse on: prefill on this node when the prompt tokens it lacks are at most this "
        "many (0: only when no prefill node is usable; default 16)",
    )
    p.add_argument(
        "--kv-pull-min-blocks",
        type=int,
        default=None,
        help="with --kv-reuse on: send the prompt blocks this node holds to the prefill node (D->P pull) "
        "when it lacks at least this many, instead of it recomputing them (0: never; default 1)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.decode_node import DecodeNode

    return serve("decode", node_config(args, "decode"), DecodeNode)
