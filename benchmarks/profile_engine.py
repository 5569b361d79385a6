"""Profile our engine on this CPU into a TD-Pipe cost table (`Total Length,Execute Time`).

Times one whole-model forward (ModelRunner.run) over N tokens for a grid of N, in
two regimes: decode (N sequences of one new token each over a KV context of
`--context` tokens, used for N <= --max-decode) and prefill (one or more
sequences of up to 512 new tokens, used above). The CSV goes to
tdpipe/data/cpu-<model>.csv in the authors' format, so the simulator can run on it.
The reported ratio is the batching gain: N x time(1 token) / time(N tokens) at
the largest N (how much cheaper a token gets in a big batch on this CPU).

    python -m benchmarks.profile_engine [--quick] [--model tiny|bench]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import emit

ROOT = Path(__file__).resolve().parent.parent


def make_batch(num_tokens: int, decode: bool, context: int, block_size: int):
    from pdserve.engine.block_manager import blocks_for
    from pdserve.engine.forward_batch import ForwardBatch

    seqs = [1] * num_tokens if decode else [min(512, num_tokens - i) for i in range(0, num_tokens, 512)]
    ctx = [context + 1 if decode else q for q in seqs]
    tables, next_block = [], 0
    for c in ctx:
        n = blocks_for(c, block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return ForwardBatch(
        [f"p{i}" for i in range(len(seqs))], [7] * sum(seqs), seqs, ctx, tables, [True] * len(seqs)
    ), next_block


def time_forward(runner, batch, repeats: int) -> float:
    runner.run(batch)  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.run(batch)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="coarse grid, 2 repeats")
    parser.add_argument("--model", default="tiny", help="built-in model size: tiny | bench")
    parser.add_argument("--context", type=int, default=128, help="KV length of decode sequences")
    parser.add_argument("--max-decode", type=int, default=256, help="largest N profiled as decode")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--out", default=None, help="CSV path (default tdpipe/data/cpu-<model>.csv)")
    args = parser.parse_args()
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.model_runner import ModelRunner

    grid = sorted(
        {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, args.max_decode}
        | (set() if args.quick else set(range(32, args.max_tokens + 1, 32)))
    )
    grid = [n for n in grid if n <= args.max_tokens]
    block_size = 16
    need = max(make_batch(n, n <= args.max_decode, args.context, block_size)[1] for n in grid)
    runner = ModelRunner(default_model_dir(args.model), dtype="float32", block_size=block_size, num_kv_blocks=need + 1)
    rows = []
    for n in grid:
        batch, _ = make_batch(n, n <= args.max_decode, args.context, block_size)
        rows.append((n, time_forward(runner, batch, 2 if args.quick else 5)))
        print(f"{n:5d} tokens: {rows[-1][1]:.2f} ms", flush=True)
    out = Path(args.out or ROOT / "pdserve" / "tdpipe" / "data" / f"cpu-{args.model}.csv")
    out.write_text("Total Length,Execute Time\n" + "".join(f"{n},{ms}\n" for n, ms in rows))
    n_max, t_max = rows[-1]
    emit(
        {
            "metric": "cpu_batching_gain",
            "value": round(t_max, 2),
            "baseline": round(n_max * rows[0][1], 2),
            "ratio": round(n_max * rows[0][1] / t_max, 2),
            "target": None,
            "unit": "ms per forward",
            "model": args.model,
            "tokens": n_max,
            "csv": str(out),
        }
    )


if __name__ == "__main__":
    main()
