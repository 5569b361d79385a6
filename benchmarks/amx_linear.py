"""Our CPU linear kernels against oneDNN's on the same packed weights: bf16 on AMX tiles
(`pdserve_cpu.amx_linear`, the default) or float32 on AVX-512 (`pdserve_cpu.f32_linear`, `--dtype float32`).

    python -m benchmarks.amx_linear                    # bf16, row counts 1-2048, 2 threads
    python -m benchmarks.amx_linear --dtype float32    # float32
    python -m benchmarks.amx_linear --quick            # 16, 128 and 512 rows, fewer rounds

One "step" is every linear of the built-in bench model once, in an engine step's order (shapes from
its config, `engine.tiny_model.SIZES["bench"]`: 12 layers of qkv 1280x768, o 768x768, gate_up
3072x768, down 768x1536, then the lm_head 32000x768; 172 MB of bf16 weights, 343 MB in float32), all on the same input
rows. `--copies` (default 4) independent sets of those weights take turns, one per step, so that a
step reads its weights from memory as an engine step does, whose attention has streamed the KV cache
through the caches in between: a CPU may report a last-level cache of a model's size (the 2-core
guests here report 480 MB, shared with other guests), and with one copy a 16-row step read part of
its weights from it (6.3 against 7.2 ms with four copies). Each weight is prepacked once by
`torch.ops.mkldnn._reorder_linear_weight`; the baseline is what `engine.layers.Linear` runs without
the kernel (`mkldnn._linear_pointwise`: oneDNN's AMX brgemm in bf16, its AVX-512 one in float32), the
candidate is the kernel reading that same packed weight. Both run in this process, interleaved round
by round, best of the rounds; `ratio` = oneDNN time / kernel time (geometric mean over the row counts
up to `engine.layers.AMX_MAX_ROWS` or `F32_MAX_ROWS`, the ones the engine sends to the kernel): above
1, the kernel is faster. bf16 needs a CPU with AMX (Sapphire Rapids or later), float32 one with
AVX-512; elsewhere it says so and exits 2. Results are compared: the largest difference from oneDNN's
output of the first qkv linear, relative to that output's largest value, is reported per row count
(summation order: about a bf16 step, 2**-8, in bf16; a few float32 ulps in float32).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from benchmarks.common import emit
from pdserve.engine.cpu_malloc import keep_freed_memory
from pdserve.engine.kernels import cpu_build
from pdserve.engine.layers import AMX_MAX_ROWS, F32_MAX_ROWS
from pdserve.engine.tiny_model import SIZES


def bench_shapes() -> list[tuple[int, int]]:
    """(out features N, in features K) of every linear of the built-in bench model, in step order."""
    c = SIZES["bench"]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * c["num_hidden_layers"] + [(c["vocab_size"], hidden)]


SHAPES = bench_shapes()


def step_ms(fn, copies: list[list[torch.Tensor]], xs: dict[int, torch.Tensor], rounds: int) -> float:
    """Best-of-`rounds` milliseconds of one pass over every linear, each pass on the next copy of
    the weights."""
    turn = 0

    def step() -> None:
        nonlocal turn
        weights = copies[turn % len(copies)]
        turn += 1
        for (_, k), w in zip(SHAPES, weights):
            fn(xs[k], w)

    for _ in copies:  # first touch, one-time setup
        step()
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
    parser.add_argument(
        "--copies", type=int, default=4, help="sets of weights taking turns, so steps read them from memory"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    bf16 = args.dtype == "bfloat16"
    dtype, max_rows = (torch.bfloat16, AMX_MAX_ROWS) if bf16 else (torch.float32, F32_MAX_ROWS)
    ready = cpu_build.amx_linear_ready if bf16 else cpu_build.f32_linear_ready
    if cpu_build.load_paged_attention_op() is None or not ready():
        what = "AMX bf16 tiles" if bf16 else "AVX-512"
        print(f"this CPU (or its kernel, or the build) has no {what}: nothing to compare", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as an engine process does: output buffers are reused, not faulted in again
    rows_list = args.rows or ([16, 128, 512] if args.quick else [1, 16, 32, 64, 128, 192, 256, 512, 1024, 2048])
    rounds = args.rounds or (2 if args.quick else 3)
    g = torch.Generator().manual_seed(0)
    if args.copies < 1:
        parser.error("--copies must be at least 1")
    copies = [
        [torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k, generator=g) * 0.05).to(dtype)) for n, k in SHAPES]
        for _ in range(args.copies)
    ]
    weights = copies[0]
    widths = sorted({k for _, k in SHAPES})

    def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    kernel_op = torch.ops.pdserve_cpu.amx_linear if bf16 else torch.ops.pdserve_cpu.f32_linear

    def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernel_op(x, w, None)

    rows_out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in widths}
        times: dict[str, list[float]] = {"onednn": [], "kernel": []}
        for _ in range(rounds):  # interleaved, so a drift of the machine's speed hits both
            times["onednn"].append(step_ms(onednn, copies, xs, 3))
            times["kernel"].append(step_ms(kernel, copies, xs, 3))
        base, ours = min(times["onednn"]), min(times["kernel"])
        k0 = SHAPES[0][1]
        want, got = onednn(xs[k0], weights[0]).double(), kernel(xs[k0], weights[0]).double()
        diff = ((got - want).abs().max() / want.abs().max()).item()
        rows_out.append(
            {
                "rows": rows,
                "onednn_ms": round(base, 2),
                "kernel_ms": round(ours, 2),
                "speedup": round(base / ours, 3),
                "max_diff_rel": float(f"{diff:.2g}"),
            }
        )
        print(f"{rows:5d} rows: oneDNN {base:7.2f} ms  kernel {ours:7.2f} ms  {base / ours:.2f}x", flush=True)
    routed = [r for r in rows_out if r["rows"] <= max_rows]
    if not routed:
        parser.error(f"no --rows at or under {max_rows}, the rows the engine sends to the kernel")
    ratio = math.exp(sum(math.log(r["speedup"]) for r in routed) / len(routed))
    emit(
        {
            "metric": "bf16_linear_step_ms_amx_vs_onednn" if bf16 else "f32_linear_step_ms_avx512_vs_onednn",
            "value": round(math.exp(sum(math.log(r["kernel_ms"]) for r in routed) / len(routed)), 2),
            "baseline": round(math.exp(sum(math.log(r["onednn_ms"]) for r in routed) / len(routed)), 2),
            "ratio": round(ratio, 3),
            "target": 1.0,
            "threads": args.threads,
            "weight_copies": args.copies,
            "dtype": args.dtype,
            "kernel_max_rows": max_rows,
            "rows": rows_out,
        }
    )


if __name__ == "__main__":
    main()
