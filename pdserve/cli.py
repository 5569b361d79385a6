"""`pdserve` command line: one subcommand per module under `pdserve/commands/`.

Each command module defines `register(subparsers)` which adds its parser and sets
`func` (called with the parsed args, returns an exit code). Modules are imported
lazily by name so that `pdserve --help` stays fast and a command's heavy imports
(torch, grpc) are paid only by the command that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.node_runtime.config import new_parser

# Order is the order shown in --help.
COMMANDS: tuple[str, ...] = (
    "generate",
    "make_tiny_model",
    "prefill",
    "decode",
    "router",
    "up",
    "simulate",
    "plan",
    "stage",
    "batch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"pdserve.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "download_dir"):  # a command that loads a model: Hub ids become cached directories
        from pdserve.commands.model_args import resolve_model_args

        resolve_model_args(args)
    code = int(args.func(args) or 0)
    if "pdserve.engine.kv_mooncake" in sys.modules:  # a node that used a Mooncake Store: see exit_process
        return sys.modules["pdserve.engine.kv_mooncake"].exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
