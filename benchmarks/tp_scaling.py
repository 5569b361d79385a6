"""Step time at tensor-parallel size 1 and 2, and the all-reduce share of a TP=2 step.

    python -m benchmarks.tp_scaling            # bench model (~110M), decode batch 32 + one 256-token prefill
    python -m benchmarks.tp_scaling --quick    # tiny model, a few rounds: a smoke run

A record, not a target: on a 2-core CPU host two ranks of one thread each split the matmuls but
add two all-reduces per layer over loopback gloo, so little gain is expected. TP=1 (one process,
all cores) is timed first, then TP=2 (rank 0 in this process, rank 1 a child, the cores shared
out); they are not interleaved, because an idle rank's threads would disturb the TP=1 steps.
Each row is the median step of `--rounds`. `allreduce_share` is rank 0's time in
all-reduces over its step time: it includes waiting for the slower rank, so it is an upper bound
on the communication itself. On a GPU machine with 2 cards, `--device cuda` runs NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


from benchmarks.common import emit
from benchmarks.profile_engine import make_batch


def time_steps(runner, batch, rounds: int, tp=None) -> tuple[float, float]:
    """Median ms of a step after one warm-up, and the median share of it spent in all-reduces."""
    runner.run(batch)
    times, share = [], []
    for _ in range(rounds):
        reduce0 = tp.all_reduce_seconds if tp is not None else 0.0
        t0 = time.perf_counter()
        runner.run(batch)
        ms = (time.perf_counter() - t0) * 1000
        times.append(ms)
        share.append(((tp.all_reduce_seconds - reduce0) * 1000 / ms) if tp is not None else 0.0)
    return statistics.median(times), statistics.median(share)


def measure(model_dir, args, batches: dict, blocks: int, tp_size: int) -> dict[str, tuple[float, float]]:
    """{phase: (median ms, all-reduce share)} of one runner at `tp_size`, stopped after."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel.launcher import TensorParallelRunner

    threads = max(1, args.threads // tp_size)
    config = EngineConfig(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=blocks,
        tensor_parallel_size=tp_size,
        num_threads=threads,
    )
    if tp_size == 1:
        runner = ModelRunner(model_dir, **config.runner_options())
    else:
        runner = TensorParallelRunner(config)
    try:
        runner.attention.wait_ready()
        return {name: time_steps(runner, b, args.rounds, runner.tp) for name, b in batches.items()}
    finally:
        runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 5 rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all: TP=1 gets them, TP=2 ranks half"
    )
    args = p.parse_args()
    from pdserve.engine.builtin import default_model_dir

    model = "tiny" if args.quick else "bench"
    if args.quick:
        args.rounds = 5
    decode, d_blocks = make_batch(args.decode_batch, True, args.context, 16)
    prefill, p_blocks = make_batch(args.prompt, False, 0, 16)
    batches, blocks = {"decode": decode, "prefill": prefill}, max(d_blocks, p_blocks) + 1
    one = measure(default_model_dir(model), args, batches, blocks, 1)
    two = measure(default_model_dir(model), args, batches, blocks, 2)
    rows = {name: (one[name][0], two[name][0], two[name][1]) for name in batches}
    for name, (a, b, s) in rows.items():
        print(f"{name:8s} TP=1 {a:8.2f} ms   TP=2 {b:8.2f} ms   all-reduce {100 * s:5.1f}% of a TP=2 step")
    a, b, s = rows["decode"]
    emit(
        {
            "metric": "tp2_decode_step_ms",
            "value": round(b, 2),
            "baseline": round(a, 2),
            "ratio": round(a / b, 3),
            "target": None,
            "unit": "ms per step (median); baseline TP=1, ratio TP=1/TP=2 (speed-up)",
            "allreduce_share_decode": round(s, 3),
            "prefill_ms_tp1": round(rows["prefill"][0], 2),
            "prefill_ms_tp2": round(rows["prefill"][1], 2),
            "allreduce_share_prefill": round(rows["prefill"][2], 3),
            "device": args.device,
            "backend": "nccl" if args.device.startswith("cuda") else "gloo",
            "model": model,
            "rounds": args.rounds,
            "decode_batch": args.decode_batch,
            "threads": args.threads,
            "prompt": args.prompt,
        }
    )


if __name__ == "__main__":
    main()
