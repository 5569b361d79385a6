"""`pdserve make-tiny-model DIR [--size tiny|bench]`: write a built-in checkpoint."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-tiny-model", help="write the deterministic built-in checkpoint (HF format)")
    p.add_argument("dir", help="output directory")
    p.add_argument(
        "--size",
        choices=["tiny", "bench"],
        default="tiny",
        help="tiny: loads in milliseconds; bench: ~110M parameters for benchmarks",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, args.size)
    print(f"wrote {args.size} model to {out}")
    return 0
