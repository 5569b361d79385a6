"""`pdserve batch`: run an OpenAI Batch file through the offline pipeline (tdpipe/runtime)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from pdserve.commands.device_args import add_device_args, device_options
from tdpipe.simulator import CLI_NAMES

POLICIES = tuple(CLI_NAMES)
"""The simulator's own policy objects, driving the real stages."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("batch", help="offline batch job: OpenAI Batch JSONL in, results JSONL out")
    p.add_argument("-i", "--input", required=True, help="input JSONL (custom_id, method, url, body per line)")
    p.add_argument("-o", "--output", required=True, help="output JSONL; each result is appended as it completes")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (processes), each holding a layer slice")
    p.add_argument("--policy", default=POLICIES[0], choices=POLICIES,
                   help="schedule: tdpipe (temporally disaggregated prefill and decode phases, one decode batch "
                        "in flight per stage), pp-sb (pipeline parallelism with separate batching, vLLM-style "
                        "virtual engines) or pp-hb (the same with chunked-prefill hybrid batches)")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks per stage")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per prefill batch")
    p.add_argument("--resume", action="store_true", help="skip custom_ids already in the output file")
    p.add_argument("--stats", default=None, help="write the job summary as JSON to this file")
    add_device_args(p)
    p.set_defaults(func=run)


def _done_ids(path: str) -> set[str]:
    """custom_ids already answered; a torn last line (killed mid-write) is dropped from the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    lines, done, good = data.split(b"\n"), set(), 0
    for raw in lines:
        try:
            done.add(json.loads(raw)["custom_id"])
            good += len(raw) + 1
        except (ValueError, KeyError, TypeError):
            break  # a torn line can only be the last one: everything after it is ours to redo
    with open(path, "r+b") as f:
        f.truncate(min(good, len(data)))
    return done


def _bubble_fraction(timelines: list) -> float | None:
    fracs = []
    for spans in timelines:
        if spans:
            wall = spans[-1][1] - spans[0][0]
            fracs.append(1.0 - sum(e - s for s, e, *_ in spans) / wall if wall > 0 else 0.0)
    return sum(fracs) / len(fracs) if fracs else None


def _on_term(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.builtin import default_model_dir
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer
    from pdserve.commands.batch_job import BatchJob

    model_dir = str(args.model or default_model_dir())
    try:
        device = device_options(args)["device"]
        cfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer(model_dir)
        done = _done_ids(args.output) if args.resume else set()
        with open(args.input, encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_term)
    with open(args.output, "a" if args.resume else "w", encoding="utf-8") as out:
        job = BatchJob(args, model_dir, device, tokenizer, cfg.max_position_embeddings, out)
        bar = tqdm(total=len(lines), desc="batch", unit="req", file=sys.stderr, dynamic_ncols=True)
        job.progress = bar
        start = time.perf_counter()
        try:
            stats, timelines = job.run(lines, done)
        except KeyboardInterrupt:
            bar.close()
            print(f"interrupted: {job.written} results written; rerun with --resume to finish", file=sys.stderr)
            return 130
        except Exception as e:  # a stage died: what was written stays, --resume finishes the rest
            bar.close()
            print(f"error: {e}; {job.written} results written; rerun with --resume", file=sys.stderr)
            return 1
        bar.close()
    elapsed = time.perf_counter() - start
    summary = {"requests": len(lines), "skipped_resume": job.skipped, "completed": job.completed,
               "errors": job.errors, "output_tokens": stats.output_tokens, "seconds": round(elapsed, 3),
               "output_tokens_per_s": round(stats.output_tokens / elapsed, 2) if elapsed > 0 else None,
               "phase_switches": len(stats.phase_switches), "preemptions": stats.num_preemptions,
               "bubble_fraction": _bubble_fraction(timelines), "stages": args.stages, "policy": args.policy}
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    if args.stats:
        with open(args.stats, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0
