"""Decode attention over the paged KV pool: the compiled `cpu_paged` op against the torch path.

    python -m benchmarks.attention_kernel            # bench-model heads, contexts 512 and 2048, fp32 and bf16
    python -m benchmarks.attention_kernel --quick    # one context, fewer rounds

One decode token per sequence reads its pages in place through `torch.ops.pdserve_cpu.paged_attention`;
the baseline is what a node runs without the op (`engine.attention.torch_backend.chunk_attention`:
gather the pages, then SDPA), timed in the same process, interleaved round by round, one thread.
Both outputs are compared (max abs difference). `ratio` = baseline time / op time over the rows
(geometric mean): above 1, the op is faster. The machine's ISA matters (AVX-512 or AVX2): see
`machine` in the JSON line.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.common import emit
from engine.attention.cpu_build import load_paged_attention_op
from engine.attention.torch_backend import chunk_attention

HQ, HKV, D, BLOCK = 12, 4, 64, 16  # the bench model's attention geometry


def one_row(op, dtype: torch.dtype, batch: int, ctx: int, rounds: int) -> dict:
    """Best-of-`rounds` time of one decode step's attention for `batch` sequences of `ctx` keys."""
    g = torch.Generator().manual_seed(0)
    pages = -(-ctx // BLOCK)
    kv = torch.randn(batch * pages, 2, HKV, BLOCK, D, generator=g).to(dtype)
    q = torch.randn(batch, HQ, D, generator=g).to(dtype)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    table = torch.tensor(tables, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    ctxs = torch.full((batch,), ctx, dtype=torch.int32)
    scale = D**-0.5

    def kernel() -> torch.Tensor:
        return op(q, kv, table, starts, ctxs, scale, 0)

    def torch_path() -> torch.Tensor:
        return torch.cat([chunk_attention(q[i : i + 1], kv, tables[i], ctx, BLOCK, scale) for i in range(batch)])

    diff = (kernel().float() - torch_path().float()).abs().max().item()
    best = {"kernel": math.inf, "torch": math.inf}
    for _ in range(rounds):
        for name, fn in (("kernel", kernel), ("torch", torch_path)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": ctx,
        "kernel_us": round(best["kernel"] * 1e6, 1),
        "torch_us": round(best["torch"] * 1e6, 1),
        "speedup": round(best["torch"] / best["kernel"], 2),
        "max_abs_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    op = load_paged_attention_op()
    if op is None:
        raise SystemExit("the cpu_paged op could not be built here (no C++ compiler?): nothing to compare")
    torch.set_num_threads(1)
    contexts = (512,) if args.quick else (512, 2048)
    rounds = 5 if args.quick else 20
    rows = [
        one_row(op, dtype, batch, ctx, rounds)
        for dtype in (torch.float32, torch.bfloat16)
        for ctx in contexts
        for batch in (1, 8)
    ]
    for r in rows:
        print(r)
    geo = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    kernel_total = sum(r["kernel_us"] for r in rows)
    torch_total = sum(r["torch_us"] for r in rows)
    emit(
        {
            "metric": "decode_attention_speedup_over_torch_path",
            "value": round(kernel_total, 1),
            "baseline": round(torch_total, 1),
            "ratio": round(geo, 3),
            "target": 1.0,
            "unit": "microseconds summed over the rows (value: op, baseline: torch path)",
            "rows": rows,
        }
    )


if __name__ == "__main__":
    main()
