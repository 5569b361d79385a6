"""The batch job from parsed arguments: read the input, run the pipeline, append the output, report.

Exit codes: 0 done (error lines included), 1 the pipeline failed (a stage died), 2 bad
arguments or unreadable files, 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM). In every
non-zero case the lines already written stay valid and `--resume` finishes the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from pdserve.engine.generation_defaults import DEFAULT_GENERATION_CONFIG, generation_defaults
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import TPShard
from pdserve.engine.tokenizer import Tokenizer
from pdserve.tdpipe.runtime.batch_config import BatchConfig
from pdserve.tdpipe.runtime.batch_input import count_lines, read_lines
from pdserve.tdpipe.runtime.batch_job import BatchJob, table_choice
from pdserve.tdpipe.runtime.batch_kv import stage_kv_blocks
from pdserve.tdpipe.runtime.batch_lengths import LengthPlanner
from pdserve.tdpipe.runtime.batch_metrics import BatchMetrics
from pdserve.tdpipe.runtime.batch_output import OrderedWriter, open_output
from pdserve.tdpipe.runtime.batch_url import local_output, open_input, upload
from pdserve.tdpipe.runtime.batch_watchdog import StageWatchdog
from pdserve.tdpipe.runtime.stage_split import resolve_phase_split


def _bubble_fraction(timelines: list) -> float | None:
    """Mean over stages of the idle share of each stage's busy window (first start to last end)."""
    fracs = []
    for spans in timelines:
        if spans:
            wall = spans[-1][1] - spans[0][0]
            fracs.append(1.0 - sum(e - s for s, e, *_ in spans) / wall if wall > 0 else 0.0)
    return sum(fracs) / len(fracs) if fracs else None


def run_batch(args: BatchConfig, device: dict[str, str]) -> int:
    """Run the job `args` describes on `device` (device_args.device_options); the exit code."""
    from tqdm import tqdm

    model_dir = args.model
    try:
        table_choice(args.cost_table, device["device"], args.external_stages)  # a bad name fails before any work
        cfg = ModelConfig.from_dir(model_dir)
        if args.stages > cfg.num_hidden_layers:
            raise ValueError(f"--stages {args.stages} is more than the model's {cfg.num_hidden_layers} layers")
        TPShard(0, args.tensor_parallel_size).check(cfg)  # every stage splits its layers N ways
        if args.max_lines_in_flight < 1:
            raise ValueError(f"--max-lines-in-flight must be at least 1, got {args.max_lines_in_flight}")
        tokenizer = Tokenizer(model_dir)
        lengths = LengthPlanner(args.length_predictor)
        # generation_config.json's sampling defaults for fields a line leaves unset, as the router applies them
        args = args.resolved(
            sampling_defaults=generation_defaults(args.generation_config or DEFAULT_GENERATION_CONFIG, model_dir),
            split_by_phase=resolve_phase_split(
                args.phase_split, device["device"], args.tensor_parallel_size, args.external_stages
            ),
        )
        # at most a window of lines is in flight: the KV never needs more than they can fill
        args = args.resolved(num_kv_blocks=stage_kv_blocks(args, cfg, device["device"], args.max_lines_in_flight))
        stream = open_input(args.input)
        out_path = local_output(args.output, args.local_output_dir)
        out, done = open_output(out_path, args.resume)  # locked: a second job on this output fails here
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with out, stream:
        # a terminal gets a live bar; a log (a Kubernetes pod) one line every 30 s
        bar = tqdm(
            total=count_lines(args.input),
            desc="batch",
            unit="req",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 30.0,
        )
        metrics: BatchMetrics | None = None

        def on_write(row: dict) -> None:
            bar.update(1)
            if metrics is not None:
                metrics.observe(row)

        writer = OrderedWriter(out, args.output_order, on_write)
        job = BatchJob(args, model_dir, device, tokenizer, cfg.max_position_embeddings, writer)
        job.lengths = lengths
        lines = read_lines(stream, args.max_line_bytes)
        if args.enable_metrics:
            metrics = BatchMetrics(job.model_name, args.stages)
            try:
                metrics.serve(args.port, args.metrics_host, lambda: job.executor, lambda: writer.in_flight)
            except OSError as e:
                print(f"error: --port {args.port}: {e}", file=sys.stderr)
                return 2
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
                f"interrupted by {name}: {job.written} lines written to {out_path}; rerun with --resume to finish",
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
                    f"internal error: {type(e).__name__}: {e}. {job.written} lines written to {out_path}; "
                    f"rerun with --resume to finish",
                    file=sys.stderr,
                )
                return 1
            dead = watchdog.wait_for_dead(timeout=5.0)
            if watchdog.stalled:
                why = "pipeline stage stalled: " + watchdog.stalled[0]
            elif dead:
                why = "pipeline stage died: " + dead[0]
                if len(dead) > 1:
                    why += f" (then, stopped after it: {'; '.join(dead[1:])})"
            elif args.external_stages:
                why = f"pipeline failed ({e}); check the logs of the `pdserve stage` ranks"
            else:
                why = f"pipeline failed: {e}"
            print(
                f"error: {why}. {job.written} lines written to {out_path}; rerun with --resume to finish",
                file=sys.stderr,
            )
            return 1
        finally:
            watchdog.close()
        bar.close()
    elapsed = time.perf_counter() - start
    bubble = _bubble_fraction(timelines)
    if metrics is not None:
        metrics.finish(bubble)
    if out_path != args.output:  # an http(s) output: the local file is complete, upload it
        try:
            upload(out_path, args.output)
        except OSError as e:
            print(f"error: {e}; rerun with --resume to upload again", file=sys.stderr)
            return 1
        os.unlink(out_path)
    running = elapsed - job.profile_seconds  # throughput of the pipeline itself; profiling is reported apart
    summary = {
        "requests": job.source.read if job.source else 0,
        "skipped_resume": job.skipped,
        "completed": job.completed,
        "errors": job.errors,
        "output_tokens": stats.output_tokens,
        "seconds": round(elapsed, 3),
        "profile_seconds": round(job.profile_seconds, 3),
        "profile_cached": job.profile_reused,
        "output_tokens_per_s": round(stats.output_tokens / running, 2) if running > 0 else None,
        "phase_switches": len(stats.phase_switches),
        "preemptions": stats.num_preemptions,
        "bubble_fraction": bubble,
        "stages": args.stages,
        "phase_split": args.split_by_phase,
        "policy": args.policy,
        "cost_table": job.table_name,
    }
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    if args.stats:
        with open(args.stats, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0
