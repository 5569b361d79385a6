"""`pdserve decode`: run a decode node."""

from __future__ import annotations

import argparse

from pdserve.commands.node_common import add_node_args, advertise_host, engine_config, node_options, serve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode", help="run a decode node (gRPC Decode service + CacheStore receiver)")
    add_node_args(p, default_port=50071)
    p.add_argument("--cachestore-port", type=int, default=0, help="CacheStore listener port (0: pick a free one)")
    p.add_argument("--colocated", action="store_true",
                   help="also run prompts locally when a request names no prefill node (monolithic baseline)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decode_node import DecodeNode
    # a decode node never drops KV to make room: it refuses admission instead
    config = engine_config(args, preemption="never", max_num_batched_tokens=args.max_num_batched_tokens)
    node = DecodeNode(config, node_options(args), cachestore_port=args.cachestore_port, colocated=args.colocated,
                      advertise_host=advertise_host(args))
    return serve(node, "decode", args)
