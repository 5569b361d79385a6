"""The elementwise steps of a decoder layer as one Triton kernel each, for CUDA.

Why: `EagerOps` spends about 35 small kernels per layer on what is three passes (a residual add
and RMSNorm, twice; the rotary embedding; SiLU-and-multiply). At decode batch sizes each of those
kernels costs launch latency, not bandwidth, and even inside a CUDA graph 32 layers of them added
about 3 ms to an 8B model's 3.5 ms weight read on an H200 (benchmarks/gpu_decode.py). Here each
step is one kernel.

Each kernel rounds where the eager chain rounds (to the model's dtype after the add, after the
normalisation, after each product of the rotation, after SiLU). Compiled on an H200 the residual
stream came out bit for bit equal to the eager ops'; the norm (its mean of squares summed in
another order), SiLU (Triton's exp) and the rotation differ by at most an ulp or two of the model's
dtype, in a few elements (tests/gpu/test_cuda_graphs_gpu.py). CPU tests run them under Triton's
interpreter against EagerOps (tests/engine/test_cuda_ops.py).
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.attention import triton_decode
from pdserve.engine.layers import EagerOps, Linear


def available(device: torch.device) -> bool:
    """Whether a CUDA model runs these kernels (CUDA, and Triton imports)."""
    return device.type == "cuda" and triton_decode.available()


@functools.cache
def _kernels():  # built on first use: importing this module needs no triton
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:  # x += residual, rounded to the model's dtype and kept (the residual stream)
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * rstd).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, out, mask=mask)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_t, stride_c, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)  # the q heads, then the k heads: side by side in each qkv row
        offs = tl.arange(0, HALF_PAD)
        mask = offs < HALF
        base = qkv_ptr + t * stride_t + head * 2 * HALF
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
        c1 = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded after each product and the sum as the eager ops do
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(base + offs, o1, mask=mask)
        tl.store(base + HALF + offs, o2, mask=mask)

    return add_rms_norm_kernel, silu_mul_kernel, rotary_kernel


class CudaFusedOps(EagerOps):
    """`EagerOps`' steps, one Triton kernel each (CUDA; the GEMMs stay cuBLAS's)."""

    @staticmethod
    def linear(lin: Linear, x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.stride(-1) != 1 or (residual is not None and (residual.stride(-1) != 1 or residual.dtype != x.dtype)):
            return EagerOps.add_rms_norm(x, residual, weight, eps)
        rows, n = x.shape
        out = torch.empty_like(x)
        block = triton_decode.pow2_at_least(n)
        _kernels()[0][(rows,)](
            x, residual if residual is not None else x, weight, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), n, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
        return out

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.stride(-1) != 1:
            return EagerOps.silu_mul(gate_up)
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        _kernels()[1][(rows, (inter + block - 1) // block)](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
        )
        return out

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """In place on qkv's q and k heads (a GEMM's fresh output), as the CPU ops do."""
        if qkv.stride(-1) != 1 or cos.shape[-1] != d or d % 2 or cos.dtype != qkv.dtype:
            return EagerOps.rotate_qk(qkv, cos, sin, hq, hkv, d)
        cos2, sin2 = cos.reshape(cos.shape[0], d), sin.reshape(sin.shape[0], d)
        _kernels()[2][(qkv.shape[0], hq + hkv)](
            qkv,
            cos2,
            sin2,
            qkv.stride(0),
            cos2.stride(0),
            HALF=d // 2,
            HALF_PAD=triton_decode.pow2_at_least(d // 2),
            num_warps=1,
        )
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
