"""`pdserve stage`: one TD-Pipe pipeline stage worker (rank/world from torch.distributed env)."""

from __future__ import annotations

import argparse
import sys

from pdserve.commands.config_flags import config_flag
from pdserve.commands.device_args import add_device_args, add_tensor_parallel_arg, device_options


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.commands.memory_args import add_stage_kv_memory_arg
    from pdserve.engine.config import DTYPES
    from pdserve.tdpipe.runtime.batch_config import FIXED_DEFAULT_BLOCKS
    from pdserve.tdpipe.runtime.stage_config import StageConfig

    p = subparsers.add_parser("stage", help="run one offline pipeline stage (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)")
    p.add_argument("--model-dir", required=True, help="checkpoint directory (the stage loads only its layers)")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help=f"KV blocks per stage, as the controller's (default: from --kv-cache-memory, else {FIXED_DEFAULT_BLOCKS})",
    )
    add_stage_kv_memory_arg(p)  # the same count as `pdserve batch` derives
    config_flag(p, StageConfig, "block_size", keep_default=True)
    add_device_args(p)  # a bare `cuda` gives each stage its own N GPUs ($LOCAL_RANK, else stage index)
    add_tensor_parallel_arg(
        p, expert_parallel=False
    )  # this stage is a group of N rank processes; this one talks to the pipeline
    config_flag(p, StageConfig, "dtype", choices=DTYPES, keep_default=True)
    config_flag(p, StageConfig, "num_threads", keep_default=True)
    config_flag(p, StageConfig, "init_timeout", keep_default=True)
    # set by the local launcher of `pdserve batch` only (stage_worker.StageConfig): its stages share a
    # KV file it creates, which stages started elsewhere cannot map
    p.add_argument("--phase-split", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kv-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.parallel.group import RankFailure
    from pdserve.tdpipe.runtime.stage_config import StageConfig
    from pdserve.tdpipe.runtime.stage_worker import main_from_env
    from pdserve.tdpipe.runtime.wire import RendezvousTimeout

    try:
        tp = args.tensor_parallel_size or 1
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
        args.model = args.model_dir  # device_options reads the checkpoint's dtype for the backend choice
        device = device_options(args)
        cfg = StageConfig(
            model_dir=args.model_dir,
            num_kv_blocks=_num_kv_blocks(args, device["device"]),
            block_size=args.block_size,
            dtype=args.dtype,
            num_threads=args.num_threads,
            init_timeout=args.init_timeout,
            tensor_parallel_size=tp,
            phase_split=args.phase_split,
            kv_fd=args.kv_fd,
            device=device["device"],
            attention_backend=device["attention_backend"],
        )
        return main_from_env(cfg)
    except (ValueError, RendezvousTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:  # a rank of this stage's tensor-parallel group died or hung
        print(f"error: {e}", file=sys.stderr)
        return 1


def _num_kv_blocks(args: argparse.Namespace, device: str) -> int:
    """What `pdserve batch --external-stages` derives from the same flags (tdpipe/runtime/batch_kv)."""
    import os

    from pdserve.engine.model_config import ModelConfig
    from pdserve.tdpipe.runtime.batch_kv import stage_kv_blocks

    world = int(os.environ.get("WORLD_SIZE", "2"))  # main_from_env refuses a missing one
    # external stages never split by phase (resolve_phase_split)
    sized = argparse.Namespace(**vars(args), stages=max(world - 1, 1), external_stages=True, split_by_phase=False)
    return stage_kv_blocks(sized, ModelConfig.from_dir(args.model_dir), device, num_lines=0)
