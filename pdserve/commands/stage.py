"""`pdserve stage`: one TD-Pipe pipeline stage worker (rank/world from torch.distributed env)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("stage", help="run one offline pipeline stage (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)")
    p.add_argument("--model-dir", required=True, help="checkpoint directory (the stage loads only its layers)")
    p.add_argument("--num-kv-blocks", type=int, required=True, help="KV blocks per stage (same on every stage)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA + NCCL not exercised on these machines)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of this stage")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tdpipe.runtime.stage_worker import StageConfig, main_from_env
    cfg = StageConfig(model_dir=args.model_dir, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                      device=args.device, dtype=args.dtype, num_threads=args.num_threads)
    try:
        return main_from_env(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
