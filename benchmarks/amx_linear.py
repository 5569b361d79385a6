"""bf16 linears on AMX: `pdserve_cpu.amx_linear` against oneDNN's kernel on the same packed weights.

    python -m benchmarks.amx_linear            # row counts 1-2048, 2 threads
    python -m benchmarks.amx_linear --quick    # 16, 128 and 512 rows, fewer rounds

One "step" is every linear of the bench model once (12 layers of qkv 2304x768, o 768x768, gate_up
3072x768, down 768x1536, then the lm_head 32000x768: 190 MB of bf16 weights, more than the caches,
so the weights come from memory as in an engine step), all on the same input rows. Each weight is
prepacked once by `torch.ops.mkldnn._reorder_linear_weight`; the baseline is what `engine.layers.Linear`
runs without the kernel (`mkldnn._linear_pointwise`, oneDNN's AMX brgemm), the candidate is the
kernel reading that same packed weight. Both run in this process, interleaved round by round, best of
the rounds; `ratio` = oneDNN time / kernel time (geometric mean over the row counts up to
`engine.layers.AMX_MAX_ROWS`, the ones the engine sends to the kernel): above 1, the kernel is faster.
Needs a CPU with AMX (Sapphire Rapids or later); elsewhere it says so and exits 2. Results are
compared: the largest difference from oneDNN's output of the first qkv linear, relative to that
output's largest value, is reported per row count (summation order: about a bf16 step, 2**-8).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from benchmarks.common import emit
from engine.attention import cpu_build
from engine.cpu_malloc import keep_freed_memory
from engine.layers import AMX_MAX_ROWS

LAYERS = 12
SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 1536)] * LAYERS + [(32000, 768)]


def step_ms(fn, weights: list[torch.Tensor], xs: dict[int, torch.Tensor], rounds: int) -> float:
    """Best-of-`rounds` milliseconds of one pass over every linear."""

    def step() -> None:
        for (_, k), w in zip(SHAPES, weights):
            fn(xs[k], w)

    step()  # first touch, one-time setup
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 row counts, fewer rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row count")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts to time (default: 1-2048)")
    args = parser.parse_args()
    if cpu_build.load_paged_attention_op() is None or not cpu_build.amx_linear_ready():
        print("this CPU (or its kernel, or the build) has no AMX bf16 tiles: nothing to compare", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as an engine process does: output buffers are reused, not faulted in again
    rows_list = args.rows or ([16, 128, 512] if args.quick else [1, 16, 32, 64, 128, 192, 256, 512, 1024, 2048])
    rounds = args.rounds or (2 if args.quick else 3)
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k, generator=g) * 0.05).bfloat16()) for n, k in SHAPES
    ]

    def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve_cpu.amx_linear(x, w, None)

    rows_out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (768, 1536)}
        times: dict[str, list[float]] = {"onednn": [], "amx": []}
        for _ in range(rounds):  # interleaved, so a drift of the machine's speed hits both
            times["onednn"].append(step_ms(onednn, weights, xs, 3))
            times["amx"].append(step_ms(kernel, weights, xs, 3))
        base, ours = min(times["onednn"]), min(times["amx"])
        want, got = onednn(xs[768], weights[0]).double(), kernel(xs[768], weights[0]).double()
        diff = ((got - want).abs().max() / want.abs().max()).item()
        rows_out.append(
            {
                "rows": rows,
                "onednn_ms": round(base, 2),
                "amx_ms": round(ours, 2),
                "speedup": round(base / ours, 3),
                "max_diff_rel": float(f"{diff:.2g}"),
            }
        )
        print(f"{rows:5d} rows: oneDNN {base:7.2f} ms  AMX kernel {ours:7.2f} ms  {base / ours:.2f}x", flush=True)
    routed = [r for r in rows_out if r["rows"] <= AMX_MAX_ROWS]
    ratio = math.exp(sum(math.log(r["speedup"]) for r in routed) / len(routed))
    emit(
        {
            "metric": "bf16_linear_step_ms_amx_vs_onednn",
            "value": round(math.exp(sum(math.log(r["amx_ms"]) for r in routed) / len(routed)), 2),
            "baseline": round(math.exp(sum(math.log(r["onednn_ms"]) for r in routed) / len(routed)), 2),
            "ratio": round(ratio, 3),
            "target": 1.0,
            "threads": args.threads,
            "amx_max_rows": AMX_MAX_ROWS,
            "rows": rows_out,
        }
    )


if __name__ == "__main__":
    main()
