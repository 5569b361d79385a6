"""FP8 block-quantized linears on CUDA Hopper: the weights stay float8_e4m3fn with their 128x128
block scales, each activation is quantized per token and group of 128 along K, and one block-scaled
GEMM (`torch.nn.functional.scaled_mm`, cuBLASLt) multiplies them.

When: `fp8_gemm_supported` decides at load. The FP8 GEMM runs on CUDA devices of compute capability
9.x in bfloat16 or float16; everywhere else (CPU, CUDA before Hopper, Blackwell, float32, or
`PDSERVE_FP8_GEMM=0`) the weights are dequantized at load (`dequantize_fp8_block`) and the
linears are ordinary ones. Blackwell is excluded because torch runs the (1x128, 128x128) recipe on
SM90 only: on any other CUDA major it raises NotImplementedError ("DeepSeek style scaling only
supported in CUDA for SM90", aten/src/ATen/native/cuda/ScaledBlas.cpp).

Numerics: the weights are exactly the checkpoint's; the activations lose precision to e4m3 (3
mantissa bits, per-group scale amax / 448), so results are close to, not equal to, the dequantized
model's (tests/gpu/test_cuda_fp8.py states the tolerance). Experts of MoE layers stay dequantized
(`weights.load_tensors`): torch has no block-scaled grouped GEMM of this recipe.

Layouts (what torch's `_scaled_mm_v2` checks, pinned on CPU by tests/engine/test_fp8_gemm.py
through torch's own meta kernel):
- mat_a: the quantized activation [M, K], row-major; K a multiple of 16 (here of 128).
- scale_a (BlockWise1x128): float32 [M, K/128] with strides (1, M): M-major ("outer-dim-major").
- mat_b: the weight [N, K] as stored, passed as its transpose [K, N] (column-major).
- scale_b (BlockWise128x128): float32 [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to a
  multiple of 4: the checkpoint's [N/128, K/128] scales with zero columns padded to L4, transposed.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from pdserve.engine.layers import Linear

log = logging.getLogger(__name__)

BLOCK = 128
"""The quantization block edge: weights in 128x128 blocks, activations in 1x128 groups along K."""
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""448: the largest float8_e4m3fn value; a group's scale maps its amax onto it."""
AMAX_EPS = 1e-10
"""Floor of a group's amax, so an all-zero group gets a finite scale (its values quantize to 0)."""
FORCE_DEQUANTIZE_ENV = "PDSERVE_FP8_GEMM"
"""`PDSERVE_FP8_GEMM=0`: dequantize FP8 checkpoints at load even where FP8 GEMMs run (debugging)."""
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
"""The model dtypes the FP8 GEMM writes; float32 runs dequantized (exactness over speed)."""


def fp8_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FP8 block-quantized linears run as FP8 GEMMs here, else dequantized at load.
    Decided once, at load: see the module docstring for each condition."""
    return fp8_gemm_unavailable(device, dtype) is None


def fp8_gemm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FP8 GEMMs do not run on `device` in `dtype` (None: they do)."""
    if os.environ.get(FORCE_DEQUANTIZE_ENV, "1") == "0":
        return f"{FORCE_DEQUANTIZE_ENV}=0"
    if device.type != "cuda":
        return f"device {device.type}"
    if dtype not in COMPUTE_DTYPES:
        return f"dtype {dtype} (FP8 GEMMs write bfloat16 or float16)"
    if not _torch_has_block_scaled_mm():
        return f"torch {torch.__version__} has no scaled_mm with BlockWise1x128/BlockWise128x128"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor} (torch's 1x128/128x128 FP8 GEMM is SM90 only)"
    return None


def _torch_has_block_scaled_mm() -> bool:
    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and hasattr(scaling, "BlockWise1x128") and hasattr(scaling, "BlockWise128x128")


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (float8_e4m3fn [M, K] row-major, float32 scales
    [M, K/128] row-major): each group of 128 along K is divided by scale = max(amax, AMAX_EPS) / 448
    and saturated to +-448, so x ~= q * scale group by group. Computed in float32."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"activation width {k} is not a multiple of {BLOCK}")
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_EPS)
    scale = amax / FP8_MAX
    # x / scale can round a hair past 448 at the group's maximum: saturate, never overflow to NaN
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), scale.reshape(m, k // BLOCK)


def scale_a_layout(scales: torch.Tensor) -> torch.Tensor:
    """Activation scales [M, K/128] as the BlockWise1x128 operand wants them: same values, strides
    (1, M) (each K group's scales of all rows contiguous)."""
    return scales.t().contiguous().t()


def scale_b_layout(scale_inv: torch.Tensor) -> torch.Tensor:
    """A weight's checkpoint scales [N/128, K/128] as the BlockWise128x128 operand wants them:
    [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4 with zero columns (cuBLASLt's
    128x128 scale layout, which torch checks)."""
    nb, kb = scale_inv.shape
    l4 = -(-kb // 4) * 4
    padded = torch.zeros(nb, l4, dtype=torch.float32, device=scale_inv.device)
    padded[:, :kb] = scale_inv
    return padded.t()


def block_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(x_q * x_scale) @ (weight * w_scale).T in one FP8 GEMM: x_q [M, K] row-major with
    `scale_a_layout` scales, weight [N, K] row-major with `scale_b_layout` scales -> [M, N]."""
    return F.scaled_mm(
        x_q,
        weight.t(),
        scale_a=x_scale,
        scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_b=w_scale,
        scale_recipe_b=F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str
) -> torch.Tensor:
    """A float8_e4m3fn weight [N, K] times its per-block scales [ceil(N/bn), ceil(K/bk)], in float32
    (as the checkpoint's producer quantized it: w ~= w_fp8 * scale_inv, block by block)."""
    check_fp8_scale(tuple(weight.shape), tuple(scale_inv.shape), block, name)
    n, k = weight.shape
    bn, bk = block
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scales


def check_fp8_scale(
    weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int], name: str
) -> None:
    """ValueError unless `scale_shape` is [ceil(N/bn), ceil(K/bk)] for the 2-D weight `name` [N, K]."""
    if len(weight_shape) != 2:
        raise ValueError(f"{name}: an FP8 weight must be 2-D, got shape {tuple(weight_shape)}")
    n, k = weight_shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_shape) != want:
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale_shape)}; a [{n}, {k}] weight in {bn}x{bk} blocks needs {want}"
        )


def fp8_slice_bounds(length: int, dim: int, start: int, stop: int, name: str) -> tuple[int, int]:
    """The scale rows (dim 0) or columns (dim 1) [first, last) that cover weight indices
    [start, stop) of a weight `length` long on `dim`; ValueError, naming the tensor and the flag, if
    the slice cuts a 128-block (the scales would no longer describe the slice's blocks)."""
    if start % BLOCK or (stop % BLOCK and stop != length):
        raise ValueError(
            f"{name}: the tensor-parallel slice [{start}, {stop}) of dim {dim} (of {length}) is not aligned to "
            f"the {BLOCK}x{BLOCK} FP8 blocks, so FP8 GEMMs cannot run on it: choose another "
            f"--tensor-parallel-size, or set {FORCE_DEQUANTIZE_ENV}=0 to dequantize the weights at load"
        )
    return start // BLOCK, -(-stop // BLOCK)


def slice_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dim: int, start: int, stop: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor-parallel rank's slice [start, stop) on `dim` of an FP8 weight [N, K] and the
    matching slice of its block scales [ceil(N/128), ceil(K/128)]; refused unless 128-aligned."""
    first, last = fp8_slice_bounds(weight.shape[dim], dim, start, stop, name)
    return weight.narrow(dim, start, stop - start), scale_inv.narrow(dim, first, last - first)


class Fp8Linear(Linear):
    """y = x @ dequant(weight).T (+ bias) as one FP8 GEMM: `weight` float8_e4m3fn [N, K] as the
    checkpoint stores it, its float32 128x128 block scales, x quantized per token and 128-group on
    each call (`quantize_1x128`). N and K multiples of 128. The `Linear` interface (call, float_out,
    nbytes) over another storage; CUDA sm90 only (`fp8_gemm_supported`).

    The bias is added after the GEMM, in the output dtype, rather than in cuBLASLt's epilogue, whose
    support under block scaling torch does not document."""

    __slots__ = ("qweight", "scale_b", "dtype")

    def __init__(
        self, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> None:
        n, k = weight.shape
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"an FP8 linear takes float8_e4m3fn weights, got {weight.dtype}")
        if n % BLOCK or k % BLOCK:
            raise ValueError(f"an FP8 linear needs N and K multiples of {BLOCK}, got [{n}, {k}]")
        check_fp8_scale((n, k), tuple(scale_inv.shape), (BLOCK, BLOCK), "weight")
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"FP8 GEMMs write bfloat16 or float16, not {dtype}")
        self.out_features, self.in_features = n, k
        self.out_dtype = None  # the result is already in `dtype`: nothing for CpuCarryOps to round
        self.weight = None  # no dense copy: the FP8 weight is the only one held
        self.packed = None
        self.amx = self.f32 = False
        self.bias = bias
        self.qweight = weight.contiguous()
        self.scale_b = scale_b_layout(scale_inv.float())
        self.dtype = dtype

    @property
    def scale_inv(self) -> torch.Tensor:
        """The block scales [N/128, K/128] as the checkpoint stores them (a view of `scale_b`)."""
        return self.scale_b.t()[:, : self.in_features // BLOCK]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.size(0)
        # rows padded to a multiple of 4, a precaution: torch checks only that scale_a's column
        # stride is M, but cuBLASLt's 128x128 scales must be padded to 16 bytes (L4) and nothing
        # says an unaligned M-major column of 1x128 scales is read right. At most 3 zero rows,
        # which quantize to zeros; their outputs are dropped.
        pad = -m % 4
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        x_q, x_scale = quantize_1x128(x2)
        y = block_scaled_mm(x_q, scale_a_layout(x_scale), self.qweight, self.scale_b, self.dtype)
        if pad:
            y = y[:m]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes of weight one call reads: the FP8 weight and its block scales."""
        return self.qweight.numel() + self.scale_b.numel() * 4


def fused_linear(
    parts: list[torch.Tensor],
    scales: list[torch.Tensor | None],
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    prepack: bool = False,
    name: str = "linear",
) -> Linear:
    """One linear over the weights `parts` stacked on N (q/k/v, gate/up, or a single weight), as
    `weights.load_tensors` left them: FP8 with their scales (kept for FP8 GEMMs) or already in `dtype`
    (scales None). FP8 parts become one `Fp8Linear` when every part's N and K are multiples of 128
    (then the block rows of the scales stack like the weights); otherwise they are dequantized here,
    to `dtype`, and this one linear runs unquantized."""
    if all(s is None for s in scales):
        return Linear(parts[0] if len(parts) == 1 else torch.cat(parts), bias, prepack)
    if any(s is None for s in scales):
        raise ValueError(f"{name}: some of its fused weights are FP8 and some are not")
    if all(p.shape[0] % BLOCK == 0 and p.shape[1] % BLOCK == 0 for p in parts):
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        scale = torch.cat([s for s in scales if s is not None])
        return Fp8Linear(weight, scale, dtype, bias)
    log.info("%s: weights %s not in 128-multiples, dequantized", name, [tuple(p.shape) for p in parts])
    dense = [dequantize_fp8_block(p, s, (BLOCK, BLOCK), name).to(dtype) for p, s in zip(parts, scales) if s is not None]
    return Linear(dense[0] if len(dense) == 1 else torch.cat(dense), bias, prepack)
