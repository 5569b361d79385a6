"""`pdserve batch`: run an OpenAI Batch file through the offline pipeline (tdpipe/runtime).

Exit codes: 0 done (error lines included), 1 the pipeline failed (a stage died), 2 bad
arguments or unreadable files, 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM). In every
non-zero case the lines already written stay valid and `--resume` finishes the job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

from pdserve.commands.device_args import add_device_args, device_options
from tdpipe.simulator import CLI_NAMES

POLICIES = tuple(CLI_NAMES)
"""The simulator's own policy objects, driving the real stages."""
DEFAULT_STAGES = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("batch", help="offline batch job: OpenAI Batch JSONL in, results JSONL out")
    p.add_argument("-i", "--input", required=True, help="input JSONL (custom_id, method, url, body per line)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output JSONL; each result is appended as it completes (an existing non-empty file needs --resume)",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help=f"pipeline stages (processes), each holding a layer slice (default: {DEFAULT_STAGES}; "
        f"with --external-stages, WORLD_SIZE - 1)",
    )
    p.add_argument(
        "--policy",
        default=POLICIES[0],
        choices=POLICIES,
        help="schedule: tdpipe (temporally disaggregated prefill and decode phases, one decode batch "
        "in flight per stage), pp-sb (pipeline parallelism with separate batching, vLLM-style "
        "virtual engines) or pp-hb (the same with chunked-prefill hybrid batches)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per stage (default: from --kv-cache-memory; else on CPU a share of the available "
        "memory split among the stages, on CUDA and with --external-stages 512)",
    )
    from pdserve.commands.memory_args import add_kv_memory_args

    add_kv_memory_args(p, max_model_len=False, gpu=False)  # --kv-cache-memory is per stage
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per prefill batch")
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
        "started with the same --num-kv-blocks (default 512) and --block-size",
    )
    p.add_argument(
        "--cost-table",
        default="auto",
        help="forward-time table the schedule is planned on: profile (time each stage's layer slice "
        "on this job's batch sizes before starting; a few seconds to a minute), analytic (a "
        "GPU-like fixed + per-token cost), a named table (e.g. L20-Llama-13B, see "
        "tdpipe/data/README.md) or a CSV path (`Total Length,Execute Time` rows, ms); auto: "
        "profile for local CPU stages, analytic otherwise",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype of the stages (auto: float32 on CPU, the checkpoint's on GPU)",
    )
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per stage process")
    add_device_args(p)
    p.set_defaults(func=run)


def _done_keys(path: str) -> set:
    """What the output already answers (see batch_io.resume_key); a torn last line (killed
    mid-write) is cut off the file so that the rerun appends after the last whole line."""
    from tdpipe.runtime.batch_io import resume_key

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    done, good = set(), 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            good += len(raw) + 1
            continue
        try:
            key = resume_key(json.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError):
            break  # a torn line can only be the last one: everything after it is ours to redo
        if key is not None:
            done.add(key)
        good += len(raw) + 1
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _bubble_fraction(timelines: list) -> float | None:
    """Mean over stages of the idle share of each stage's busy window (first start to last end)."""
    fracs = []
    for spans in timelines:
        if spans:
            wall = spans[-1][1] - spans[0][0]
            fracs.append(1.0 - sum(e - s for s, e, *_ in spans) / wall if wall > 0 else 0.0)
    return sum(fracs) / len(fracs) if fracs else None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.builtin import default_model_dir
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer
    from pdserve.commands.batch_job import BatchJob, external_world, table_choice
    from pdserve.commands.batch_kv import stage_kv_blocks
    from pdserve.commands.batch_watchdog import StageWatchdog

    model_dir = str(args.model or default_model_dir())
    try:
        if args.external_stages:
            args.stages = external_world(args.stages)
        elif args.stages is None:
            args.stages = DEFAULT_STAGES
        if args.stages < 1:
            raise ValueError(f"--stages must be at least 1, got {args.stages}")
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
        args.model = model_dir  # device_options reads the checkpoint's dtype for the backend choice
        device = device_options(args)
        table_choice(args.cost_table, device["device"], args.external_stages)  # a bad name fails before any work
        cfg = ModelConfig.from_dir(model_dir)
        if args.stages > cfg.num_hidden_layers:
            raise ValueError(f"--stages {args.stages} is more than the model's {cfg.num_hidden_layers} layers")
        tokenizer = Tokenizer(model_dir)
        with open(args.input, encoding="utf-8", errors="replace") as f:
            lines = [(n, ln) for n, ln in enumerate(f.read().splitlines(), start=1) if ln.strip()]
        args.num_kv_blocks = stage_kv_blocks(args, cfg, device["device"], len(lines))
        if not args.resume and os.path.exists(args.output) and os.path.getsize(args.output) > 0:
            # rerunning after a crash without --resume would throw away every result written so far
            raise ValueError(
                f"{args.output} already has results: add --resume to finish that job, or remove the file to start over"
            )
        done = _done_keys(args.output) if args.resume else set()
        out = open(args.output, "a" if args.resume else "w", encoding="utf-8")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with out:
        job = BatchJob(args, model_dir, device, tokenizer, cfg.max_position_embeddings, out)
        # a terminal gets a live bar; a log (a Kubernetes pod) one line every 30 s
        bar = tqdm(
            total=len(lines),
            desc="batch",
            unit="req",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 30.0,
        )
        job.progress = bar
        watchdog = job.watchdog = StageWatchdog(bar)
        start = time.perf_counter()
        try:
            watchdog.install()
            stats, timelines = job.run(lines, done)
        except KeyboardInterrupt:
            bar.close()
            name = signal.Signals(watchdog.signum or signal.SIGINT).name
            print(
                f"interrupted by {name}: {job.written} lines written to {args.output}; rerun with --resume to finish",
                file=sys.stderr,
            )
            return 128 + (watchdog.signum or 2)
        except Exception as e:
            bar.close()
            if watchdog.signum is not None:  # the stages were stopped for a signal: that is the story
                print(f"interrupted: {job.written} lines written; rerun with --resume to finish", file=sys.stderr)
                return 128 + watchdog.signum
            if not isinstance(e, RuntimeError):  # not a pipeline failure (those are RuntimeErrors): our bug
                traceback.print_exc()
                print(
                    f"internal error: {type(e).__name__}: {e}. {job.written} lines written to {args.output}; "
                    f"rerun with --resume to finish",
                    file=sys.stderr,
                )
                return 1
            dead = watchdog.wait_for_dead(timeout=5.0)
            if dead:
                why = "pipeline stage died: " + dead[0]
                if len(dead) > 1:
                    why += f" (then, stopped after it: {'; '.join(dead[1:])})"
            elif args.external_stages:
                why = f"pipeline failed ({e}); check the logs of the `pdserve stage` ranks"
            else:
                why = f"pipeline failed: {e}"
            print(
                f"error: {why}. {job.written} lines written to {args.output}; rerun with --resume to finish",
                file=sys.stderr,
            )
            return 1
        finally:
            watchdog.close()
        bar.close()
    elapsed = time.perf_counter() - start
    running = elapsed - job.profile_seconds  # throughput of the pipeline itself; profiling is reported apart
    summary = {
        "requests": len(lines),
        "skipped_resume": job.skipped,
        "completed": job.completed,
        "errors": job.errors,
        "output_tokens": stats.output_tokens,
        "seconds": round(elapsed, 3),
        "profile_seconds": round(job.profile_seconds, 3),
        "output_tokens_per_s": round(stats.output_tokens / running, 2) if running > 0 else None,
        "phase_switches": len(stats.phase_switches),
        "preemptions": stats.num_preemptions,
        "bubble_fraction": _bubble_fraction(timelines),
        "stages": args.stages,
        "policy": args.policy,
        "cost_table": job.table_name,
    }
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    if args.stats:
        with open(args.stats, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0
