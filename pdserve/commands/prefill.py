"""`pdserve prefill`: run a prefill node."""

from __future__ import annotations

import argparse

from pdserve.commands.node_common import add_node_args, engine_config, node_options, serve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill node (gRPC Prefill service)")
    add_node_args(p, default_port=50061)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget per step (prompts up to this size run in one step)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefill_node import PrefillNode
    node = PrefillNode(engine_config(args, max_num_batched_tokens=args.max_num_batched_tokens), node_options(args))
    return serve(node, "prefill", args)
