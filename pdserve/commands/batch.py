"""`pdserve batch`: the flags of the offline batch job, which runs in tdpipe/runtime (batch_main).

Exit codes: 0 done (error lines included), 1 the pipeline failed (a stage died), 2 bad
arguments or unreadable files, 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.commands.batch_io_args import add_batch_io_args
from pdserve.commands.config_flags import plain_flag
from pdserve.commands.device_args import add_device_args, add_tensor_parallel_arg, device_options
from pdserve.commands.memory_args import add_stage_kv_memory_arg
from pdserve.commands.serving_args import add_generation_config_arg
from pdserve.engine.config import DTYPES
from pdserve.tdpipe.runtime.batch_config import DEFAULT_PREDICTED_LEN, FIXED_DEFAULT_BLOCKS
from pdserve.tdpipe.runtime.stage_config import DEFAULT_INIT_TIMEOUT_S
from pdserve.tdpipe.simulator import CLI_NAMES

POLICIES = tuple(CLI_NAMES)
"""The simulator's own policy objects, driving the real stages."""
DEFAULT_STAGES = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("batch", help="offline batch job: OpenAI Batch JSONL in, results JSONL out")
    p.add_argument(
        "-i",
        "--input-file",
        "--input",
        dest="input",
        required=True,
        help="input JSONL (custom_id, method, url, body per line): a path or an http(s) URL (fetched with GET)",
    )
    p.add_argument(
        "-o",
        "--output-file",
        "--output",
        dest="output",
        required=True,
        help="output JSONL, written line by line and locked against a second job (an existing non-empty file "
        "needs --resume); an http(s) URL is written locally first (--local-output-dir) and uploaded with PUT "
        "when the job ends",
    )
    add_batch_io_args(p)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help=f"pipeline stages (processes), each holding a layer slice (default: {DEFAULT_STAGES}; "
        f"with --external-stages, WORLD_SIZE - 1)",
    )
    plain_flag(
        p,
        "--policy",
        default=POLICIES[0],
        choices=POLICIES,
        help="schedule: tdpipe (temporally disaggregated prefill and decode phases, one decode batch "
        "in flight per stage), pp-sb (pipeline parallelism with separate batching, vLLM-style "
        "virtual engines) or pp-hb (the same with chunked-prefill hybrid batches)",
    )
    plain_flag(
        p,
        "--phase-split",
        default="auto",
        choices=["auto", "on", "off"],
        help="prefill batches on an equal split of the layers, decode steps on the split that weighs the "
        "LM head; stages that share a layer share its KV memory (auto: on for local CPU stages without "
        "tensor parallelism)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per stage (default: from --kv-cache-memory; else on CPU a share of the available "
        f"memory split among the stages, on CUDA and with --external-stages {FIXED_DEFAULT_BLOCKS})",
    )
    add_stage_kv_memory_arg(p)
    add_generation_config_arg(p)
    plain_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    plain_flag(p, "--max-batch-tokens", type=int, default=2048, help="tokens per prefill batch")
    p.add_argument(
        "--resume",
        action="store_true",
        help="append to the output, skipping input lines it already answers (after a crash or a stop)",
    )
    p.add_argument(
        "--stats",
        default=None,
        help="write the job summary as JSON to this file (throughput, phase switches, bubble fraction, preemptions)",
    )
    p.add_argument(
        "--external-stages",
        action="store_true",
        help="do not start local stages: act as rank 0 (the controller) of a pipeline whose "
        "`pdserve stage` ranks 1..WORLD_SIZE-1 run elsewhere, meeting at MASTER_ADDR:MASTER_PORT "
        "(e.g. the Kubernetes offline overlay); RANK must be 0 or unset. The stages must be "
        "started with the same --num-kv-blocks and --block-size (without --num-kv-blocks or "
        f"--kv-cache-memory, both sides take {FIXED_DEFAULT_BLOCKS} blocks)",
    )
    plain_flag(
        p,
        "--cost-table",
        default="auto",
        help="forward-time table the schedule is planned on: profile (time each stage's layer slice "
        "on this job's batch sizes before starting; a few seconds to a minute), analytic (a "
        "GPU-like fixed + per-token cost), a named table (e.g. L20-Llama-13B, see "
        "pdserve/tdpipe/data/README.md) or a CSV path (`Total Length,Execute Time` rows, ms); auto: "
        "profile for local CPU stages, analytic otherwise",
    )
    p.add_argument(
        "--length-predictor",
        default=None,
        help="directory of a trained output-length predictor (python -m pdserve.tdpipe.train_predictor) the "
        "planner admits requests on; default: lines with max_tokens plan on it, chat lines without "
        f"it on the median of those ({DEFAULT_PREDICTED_LEN} when none has one)",
    )
    p.add_argument(
        "--profile-cache",
        default=None,
        help="directory of cached stage profiles, one per model, dtype, device, stage count, threads, block "
        "size and attention backend, so a rerun skips profiling (default: $PDSERVE_CACHE_DIR/tdpipe-profiles, "
        "else ~/.cache/pdserve/tdpipe-profiles); off: always profile",
    )
    plain_flag(
        p,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and KV dtype of the stages (auto: float32 on CPU, the checkpoint's on GPU)",
    )
    plain_flag(p, "--num-threads", type=int, default=1, help="torch threads per stage process")
    plain_flag(
        p,
        "--init-timeout",
        type=float,
        default=DEFAULT_INIT_TIMEOUT_S,
        help="seconds to wait for every stage to join the pipeline (process start, not model loading); "
        "the job then fails with exit 1",
    )
    plain_flag(
        p,
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="a stage whose heartbeat (one a second) is silent this long is stopped, hung or cut off: the "
        "job names it and exits 1 within this + 2 s (+ 5 s to stop the others); --resume finishes the job",
    )
    add_device_args(p)
    add_tensor_parallel_arg(p, expert_parallel=False)  # each stage a group of N ranks (a bare cuda: stages x N GPUs)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.builtin import default_model_dir
    from pdserve.tdpipe.runtime.batch_config import BatchConfig
    from pdserve.tdpipe.runtime.batch_job import external_world
    from pdserve.tdpipe.runtime.batch_main import run_batch

    try:
        args.model = str(args.model or default_model_dir())  # device_options reads its dtype for the backend
        if args.external_stages:
            args.stages = external_world(args.stages)
        elif args.stages is None:
            args.stages = DEFAULT_STAGES
        if args.stages < 1:
            raise ValueError(f"--stages must be at least 1, got {args.stages}")
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
        args.tensor_parallel_size = args.tensor_parallel_size or 1
        if args.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
        device = device_options(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_batch(BatchConfig.from_args(args), device)
