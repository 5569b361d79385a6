"""Where one engine step spends its time (torch.profiler), and an interleaved A/B of the fused CPU ops.

    python -m benchmarks.profile_step --phase decode --batch 64 --dtype bfloat16
    python -m benchmarks.profile_step --phase prefill --batch 1 --ab     # fused ops vs pure torch
    python -m benchmarks.profile_step --phase decode --ab prepack        # oneDNN-prepacked linears vs F.linear

A decode step is `--batch` sequences of one new token over `--context` cached
tokens; a prefill step is `--batch` fresh prompts of `--prompt` tokens. Both use
the `cpu_paged` attention backend. `--ab fused` builds two runners that differ only in
`fused_ops` (`--ab prepack`: only in prepacked linear weights) and alternates them
`--rounds` times in this one process, so machine load hits both alike; the ratio is
median(without) / median(with).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import emit
from benchmarks.profile_engine import make_batch


def make_runner(model: str, dtype: str, blocks: int, fused_ops: bool, prepack: bool | None = None):
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(
        default_model_dir(model),
        dtype=dtype,
        num_kv_blocks=blocks + 1,
        attention_backend="cpu_paged",
        fused_ops=fused_ops,
        prepack=prepack,
    )
    runner.attention.wait_ready()
    return runner


def step_batch(args):
    if args.phase == "decode":
        return make_batch(args.batch, True, args.context, 16)
    from pdserve.engine.block_manager import blocks_for
    from pdserve.engine.forward_batch import ForwardBatch

    n = blocks_for(args.prompt, 16)
    tables = [list(range(i * n, (i + 1) * n)) for i in range(args.batch)]
    batch = ForwardBatch(
        [f"p{i}" for i in range(args.batch)],
        [7] * (args.prompt * args.batch),
        [args.prompt] * args.batch,
        [args.prompt] * args.batch,
        tables,
        [True] * args.batch,
    )
    return batch, n * args.batch


def timed(runner, batch) -> float:
    t0 = time.perf_counter()
    runner.run(batch)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--phase", default="decode", choices=["decode", "prefill"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=300, help="cached tokens per decode sequence")
    p.add_argument("--prompt", type=int, default=256, help="tokens per prefill prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--ab",
        nargs="?",
        const="fused",
        choices=["fused", "prepack"],
        help="interleaved A/B of one feature: fused ops (default) or prepacked linear weights",
    )
    p.add_argument("--eager", action="store_true", help="profile the eager elementwise ops (fused_ops=False)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--top", type=int, default=14, help="profiler rows to print")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batch, blocks = step_batch(args)
    fused = make_runner(args.model, args.dtype, blocks, not args.eager)
    if not args.ab:
        for _ in range(2):
            fused.run(batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fused.run(batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        return
    if args.ab == "prepack":
        fused = make_runner(args.model, args.dtype, blocks, True, prepack=True)
        plain = make_runner(args.model, args.dtype, blocks, True, prepack=False)
    else:
        plain = make_runner(args.model, args.dtype, blocks, False)
    a_ms, b_ms = [], []
    for r in range(args.rounds + 1):
        pair = [(plain, a_ms), (fused, b_ms)] if r % 2 else [(fused, b_ms), (plain, a_ms)]
        for runner, out in pair:
            t = timed(runner, batch)
            if r:  # round 0 is the warm-up
                out.append(t)
    a, b = statistics.median(a_ms), statistics.median(b_ms)
    emit(
        {
            "metric": f"{args.phase}_step_{args.ab}",
            "value": round(b, 2),
            "baseline": round(a, 2),
            "ratio": round(a / b, 3),
            "target": None,
            "unit": "ms per step (median)",
            "dtype": args.dtype,
            "batch": args.batch,
            "rounds": args.rounds,
            "model": args.model,
        }
    )


if __name__ == "__main__":
    main()
