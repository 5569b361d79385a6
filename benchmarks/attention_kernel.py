"""Decode attention over the paged KV pool: the compiled `cpu_paged` op against the torch path.

    python -m benchmarks.attention_kernel            # bench-model heads, contexts 512 and 2048, fp32 and bf16
    python -m benchmarks.attention_kernel --quick    # one context, fewer rounds
    python -m benchmarks.attention_kernel --against narrow [--quick]   # this CPU's kernels vs the 8-lane ones
    python -m benchmarks.attention_kernel --against sdpa [--quick]     # prompts: the prompt kernel vs SDPA

One decode token per sequence reads its pages in place through `torch.ops.pdserve_cpu.paged_attention`;
the baseline is what a node runs without the op (`engine.attention.torch_backend.chunk_attention`:
gather the pages, then SDPA), timed in the same process, interleaved round by round, one thread.
Both outputs are compared (max abs difference). `ratio` = baseline time / op time over the rows
(geometric mean): above 1, the op is faster. The machine's ISA matters (AVX-512 or AVX2): see
`machine` in the JSON line.

`--against narrow` times the op's kernels for this CPU (16 lanes on AVX-512, with bf16 scores by
vdpbf16ps on AVX512-BF16) against its 8-lane ones (`PDSERVE_CPU_NARROW=1`, what every x86-64 CPU
runs), interleaved, on 2 threads (`--threads`), a decode step of 64 sequences: one call per layer
pool of the bench model's 12, blocks scattered, so the K/V come from memory as in an engine step.
On a CPU without AVX-512 both are the 8-lane kernels and the ratio is ~1.

`--against sdpa` times prompts, not decode: one fresh prompt of 64-512 tokens through the prompt
kernel (`torch.ops.pdserve_cpu.paged_prefill_attention`, AVX-512 only) against what the node runs
without it (`causal_self_attention`: torch's causal flash SDPA over the prompt's own K/V), 2 threads,
interleaved, best of the rounds, fp32 and bf16. bf16 runs the kernel on AMX tiles where the CPU has
them (`prefill_amx_supported`; `bf16_kernel` in the JSON line says which ran) and the AVX-512 kernel
otherwise; the engine sends bf16 prompts to the kernel only in the first case
(`engine.attention.cpu_paged_backend.PROMPT_KERNEL_DTYPES`). `ratio` is the fp32 rows' speedup,
`bf16_ratio` the bf16 rows'.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from benchmarks.common import emit
from pdserve.engine.attention.torch_backend import causal_self_attention, chunk_attention
from pdserve.engine.kernels.cpu_build import load_paged_attention_op

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


def kernels_row(op, dtype: torch.dtype, batch: int, ctx: int, rounds: int, layers: int = 12) -> dict:
    """Best-of-`rounds` time of one decode step's attention (`layers` calls, one per layer pool) with
    this CPU's kernels and with the 8-lane ones."""
    g = torch.Generator().manual_seed(0)
    pages = -(-ctx // BLOCK)
    pools = [torch.randn(batch * pages, 2, HKV, BLOCK, D, generator=g).to(dtype) for _ in range(layers)]
    q = torch.randn(batch, HQ, D, generator=g).to(dtype)
    table = torch.randperm(batch * pages, generator=g).view(batch, pages).to(torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    ctxs = torch.full((batch,), ctx, dtype=torch.int32)

    def step() -> torch.Tensor:
        return torch.stack([op(q, kv, table, starts, ctxs, D**-0.5, 0) for kv in pools])

    def narrow(on: bool) -> None:
        if on:
            os.environ["PDSERVE_CPU_NARROW"] = "1"
        else:
            os.environ.pop("PDSERVE_CPU_NARROW", None)

    try:
        narrow(True)
        want = step()
        narrow(False)
        diff = (step().float() - want.float()).abs().max().item()
        best = {"kernel": math.inf, "narrow": math.inf}
        for _ in range(rounds):
            for name in best:
                narrow(name == "narrow")
                t0 = time.perf_counter()
                step()
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        narrow(False)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": ctx,
        "kernels": kernels_name(dtype),
        "kernel_us": round(best["kernel"] * 1e6, 1),
        "narrow_us": round(best["narrow"] * 1e6, 1),
        "speedup": round(best["narrow"] / best["kernel"], 2),
        "max_abs_diff": diff,
    }


def kernels_name(dtype: torch.dtype) -> str:
    """Which of the op's kernels run `dtype` on this CPU now (float32 has no dot-product variant)."""
    variant = torch.ops.pdserve_cpu.attention_kernels()
    if dtype == torch.float32:
        variant = min(variant, 1)
    return {0: "8-lane", 1: "16-lane", 2: "16-lane, bf16 dot"}[variant]


def against_narrow(op, quick: bool, threads: int) -> None:
    """`--against narrow`: this CPU's kernels against the 8-lane ones (module docstring)."""
    torch.set_num_threads(threads)
    contexts = (300,) if quick else (300, 1000)
    rounds = 5 if quick else 15
    rows = [kernels_row(op, dtype, 64, ctx, rounds) for dtype in (torch.float32, torch.bfloat16) for ctx in contexts]
    for r in rows:
        print(r)
    geo = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    emit(
        {
            "metric": "decode_attention_speedup_over_8_lane_kernels",
            "value": round(sum(r["kernel_us"] for r in rows), 1),
            "baseline": round(sum(r["narrow_us"] for r in rows), 1),
            "ratio": round(geo, 3),
            "target": 1.0,
            "unit": "microseconds of a 12-layer decode step summed over the rows (value: this CPU's kernels, "
            "baseline: the 8-lane ones)",
            "threads": threads,
            "rows": rows,
        }
    )


def prompt_row(dtype: torch.dtype, tokens: int, rounds: int) -> dict:
    """Best-of-`rounds` time of one fresh prompt's attention: the prompt kernel and causal SDPA."""
    g = torch.Generator().manual_seed(tokens)
    pages = -(-tokens // BLOCK)
    kv = torch.randn(pages, 2, HKV, BLOCK, D, generator=g).to(dtype)
    q = torch.randn(tokens, HQ, D, generator=g).to(dtype)
    pos = torch.arange(tokens)
    k, v = kv[pos // BLOCK, 0, :, pos % BLOCK], kv[pos // BLOCK, 1, :, pos % BLOCK]  # the prompt's own K/V
    table = torch.arange(pages, dtype=torch.int32)[None]
    starts, ctxs = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    scale = D**-0.5

    def kernel() -> torch.Tensor:
        return torch.ops.pdserve_cpu.paged_prefill_attention(q, kv, table, starts, ctxs, scale, 0)

    def sdpa() -> torch.Tensor:
        return causal_self_attention(q, k, v, scale)

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    best = {"kernel": math.inf, "sdpa": math.inf}
    for _ in range(rounds):
        for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / 5)
    flop = 4 * HQ * D * tokens * (tokens + 1) / 2  # QK and PV over the causal half
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "kernel_us": round(best["kernel"] * 1e6, 1),
        "sdpa_us": round(best["sdpa"] * 1e6, 1),
        "kernel_gflops": round(flop / best["kernel"] / 1e9, 1),
        "sdpa_gflops": round(flop / best["sdpa"] / 1e9, 1),
        "speedup": round(best["sdpa"] / best["kernel"], 3),
        "max_abs_diff": diff,
    }


def against_sdpa(quick: bool, threads: int) -> None:
    """`--against sdpa`: prompts through the prompt kernel against causal SDPA (module docstring)."""
    if not torch.ops.pdserve_cpu.prefill_supported(D):
        raise SystemExit("the prompt kernel needs an AVX-512 CPU: nothing to compare here")
    torch.set_num_threads(threads)
    lengths = (64, 256) if quick else (64, 128, 256, 512)
    rounds = 3 if quick else 10
    rows = [prompt_row(dtype, n, rounds) for dtype in (torch.float32, torch.bfloat16) for n in lengths]
    for r in rows:
        print(r)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    emit(
        {
            "metric": "prompt_attention_speedup_over_sdpa_float32",
            "value": round(sum(r["kernel_us"] for r in fp32), 1),
            "baseline": round(sum(r["sdpa_us"] for r in fp32), 1),
            "ratio": round(math.exp(sum(math.log(r["speedup"]) for r in fp32) / len(fp32)), 3),
            "target": 1.0,
            "unit": "microseconds of one prompt's attention summed over the float32 rows (value: prompt kernel, "
            "baseline: causal SDPA); ratio: geometric mean speedup; the bf16 rows are in `rows`",
            "threads": threads,
            "bf16_ratio": round(math.exp(sum(math.log(r["speedup"]) for r in bf16) / len(bf16)), 3),
            "bf16_kernel": "amx" if torch.ops.pdserve_cpu.prefill_amx_supported(D) else "avx512",
            "rows": rows,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--against",
        choices=["torch", "narrow", "sdpa"],
        default="torch",
        help="baseline: the torch path or the 8-lane kernels (decode), or SDPA (prompts)",
    )
    parser.add_argument("--threads", type=int, default=None, help="default: 1 against torch, 2 otherwise")
    args = parser.parse_args()
    op = load_paged_attention_op()
    if op is None:
        raise SystemExit("the cpu_paged op could not be built here (no C++ compiler?): nothing to compare")
    if args.against == "narrow":
        against_narrow(op, args.quick, args.threads or 2)
        return
    if args.against == "sdpa":
        against_sdpa(args.quick, args.threads or 2)
        return
    torch.set_num_threads(args.threads or 1)
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
