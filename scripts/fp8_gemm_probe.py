"""Probe: the FP8 block-scaled GEMM on this GPU against a float32 emulation of the same operands,
per shape, as run and with K and N padded to a multiple of 512 with zeros.

For a GPU session (scripts/gpu_check.sh runs it): on an H200 on 2026-11-30 the GEMM disagreed with
the emulation by up to ~5% of the output's range at 64 and 300 rows when K/128 or N/128 was 1 or 3,
and agreed at 1-3 rows and at 768x1024; this prints the error of each case so that the cause (the
scales' padding, the kernel cuBLASLt picks at more rows) can be read off one run.
"""

from __future__ import annotations

import torch

from pdserve.engine.fp8 import block_scaled_mm, quantize_1x128, scale_a_layout, scale_b_layout
from tests.engine.fp8_reference import quantize_weight


def emulate(x_q, x_scale, w_q, w_scale_inv):
    """(x_q * x_scale) @ (w_q * w_scale).T in float32, block by block."""
    x = x_q.float() * x_scale.repeat_interleave(128, dim=1)
    w = w_q.float() * w_scale_inv.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return x @ w.t()


def run(rows: int, n: int, k: int, pad_to: int) -> float:
    gen = torch.Generator().manual_seed(rows * n + k)
    w_q, w_scale = quantize_weight(torch.randn(n, k, generator=gen) * k**-0.5)
    x = torch.randn(rows + (-rows % 4), k, generator=gen).to(torch.bfloat16)
    x_q, x_scale = quantize_1x128(x)
    want = emulate(x_q, x_scale, w_q, w_scale)
    kp, np_ = -(-k // pad_to) * pad_to, -(-n // pad_to) * pad_to
    xq_p = torch.zeros(x_q.shape[0], kp, dtype=torch.float8_e4m3fn)
    xq_p[:, :k] = x_q
    xs_p = torch.ones(x_q.shape[0], kp // 128)
    xs_p[:, : k // 128] = x_scale
    wq_p = torch.zeros(np_, kp, dtype=torch.float8_e4m3fn)
    wq_p[:n, :k] = w_q
    ws_p = torch.ones(np_ // 128, kp // 128)
    ws_p[: n // 128, : k // 128] = w_scale
    dev = "cuda"
    got = block_scaled_mm(xq_p.to(dev), scale_a_layout(xs_p.to(dev)), wq_p.to(dev),
                          scale_b_layout(ws_p.to(dev)), torch.float32)  # fmt: skip
    got = got.float().cpu()[: x.shape[0], :n]
    return ((got - want).abs().max() / want.abs().max()).item()


def main() -> None:
    print("rows n k | error / max|out|: as run, padded to 512")
    for n, k in ((512, 128), (128, 384), (768, 1024), (512, 512), (4096, 4096)):
        for rows in (1, 3, 64, 300):
            a, c = run(rows, n, k, 128), run(rows, n, k, 512)
            print(f"{rows:4d} {n:5d} {k:5d} | {a:.2e} {c:.2e}", flush=True)


if __name__ == "__main__":
    main()
