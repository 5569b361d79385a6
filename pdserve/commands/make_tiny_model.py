"""`pdserve make-tiny-model DIR [--size tiny|bench] [--arch ARCH] [--fp8]`: write a built-in checkpoint."""

from __future__ import annotations

import argparse

from pdserve.engine.tiny_model import ARCHS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny-model", help="write a deterministic random-weight checkpoint (HF format) of any served architecture"
    )
    p.add_argument("dir", help="output directory")
    p.add_argument(
        "--size",
        choices=["tiny", "bench"],
        default="tiny",
        help="tiny: loads in milliseconds; bench: ~110M parameters for benchmarks (~240M as a MoE) (default: tiny)",
    )
    p.add_argument(
        "--arch",
        choices=list(ARCHS),
        default="llama",
        help="architecture: the Llama family, Qwen3, or the mixture-of-experts Qwen3-MoE and Mixtral "
        "(8 experts, top-2) (default: llama)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 block-quantized linear weights (float8_e4m3fn, one scale per 128x128 block), as Qwen3-*-FP8 ships",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, args.size, arch=args.arch, fp8=args.fp8)
    print(f"wrote {args.size} {args.arch}{' fp8' if args.fp8 else ''} model to {out}")
    return 0
