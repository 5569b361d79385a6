"""Small numeric building blocks of the Llama family: RMSNorm, rotary embeddings, and the
elementwise steps of a layer (eager torch, or fused C++ ops on CPU)."""

from __future__ import annotations

import ctypes
import math
import os

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_build
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rope_config import RopeScaling, YarnScaling

AMX_MAX_ROWS = 1024
"""Rows up to which a prepacked bf16 linear runs on `pdserve_cpu.amx_linear` instead of oneDNN
(decode steps and prompt chunks; csrc/cpu_amx_linear.cpp). Over the bench model's linears on
2 Sapphire Rapids cores (`python -m benchmarks.amx_linear`, weights from memory) it was 1.11-1.22x
faster than oneDNN's AMX kernel at 1-32, 128-192, 512 and 1024 rows, 1.0x at 64, 0.97x at 256, and
0.93x at 2048 (long prompt chunks, where oneDNN's blocking for many rows wins)."""


F32_MAX_ROWS = 128
"""Rows up to which a prepacked float32 linear runs on `pdserve_cpu.f32_linear` instead of oneDNN
(decode steps and short prompt chunks; csrc/cpu_f32_linear.cpp). Over the bench model's linears on
2 cores of an AMX Xeon guest, weights from memory (`python -m benchmarks.amx_linear --dtype
float32`), it was 1.2-1.3x faster than oneDNN at 1-64 rows, 1.1x at 96 and 1.05x at 128; from 192
rows on it is no faster (1.0x at 192, 0.88x at 2048: oneDNN's blocking for many rows wins)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 or YaRN scaling applied when configured."""
    if isinstance(config.rope_scaling, YarnScaling):
        return yarn_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)[0]
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend the band in between."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor, else 1."""
    if isinstance(config.rope_scaling, YarnScaling):
        return yarn_attention_factor(config.rope_scaling)
    return 1.0


def yarn_inv_freq(dim: int, base: float, s: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN over `dim` rotary dims of base `base`: (inverse frequencies [dim/2], attention factor),
    the arithmetic of transformers' `_compute_yarn_parameters` step for step, so float32 tables agree
    bit for bit. Dims turning more than `beta_fast` times over the original context keep their
    frequency, dims turning fewer than `beta_slow` times are divided by `factor`, and a linear ramp
    blends the dims in between."""
    low = _yarn_correction_dim(s.beta_fast, dim, base, s.original_max_position_embeddings)
    high = _yarn_correction_dim(s.beta_slow, dim, base, s.original_max_position_embeddings)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each dim's original (extrapolated) frequency
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, yarn_attention_factor(s)


def _yarn_correction_dim(turns: float, dim: int, base: float, max_positions: int) -> float:
    """The (fractional) dim whose wavelength fits `turns` times into `max_positions`."""
    return (dim * math.log(max_positions / (turns * 2 * math.pi))) / (2 * math.log(base))


def yarn_attention_factor(s: YarnScaling) -> float:
    """YaRN's cos/sin scale: `attention_factor` when set, else 0.1 ln(factor) + 1, or DeepSeek's ratio of
    that with `mscale` to that with `mscale_all_dim` when both are set (1 for a factor <= 1)."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding:
    """cos/sin tables for the rotate-half convention used by HF Llama checkpoints."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(config).to(device)
        self.attention_factor = rope_attention_factor(config)  # YaRN: cos/sin scaled, in float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class EagerOps:
    """The elementwise steps of a decoder layer in plain torch ops: the reference, on any device."""

    @staticmethod
    def linear(lin: Linear, x: torch.Tensor) -> torch.Tensor:
        """A GEMM whose output feeds `rotate_qk`, `add_rms_norm` (as residual) or `silu_mul`."""
        return lin(x)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += residual (in place, x: [T, H]); returns rms_norm(x)."""
        if residual is not None:
            x.add_(residual)
        return rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv: [T, (Hq + 2Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D] rotated, v [T, Hkv, D]."""
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return apply_rotary(q.view(-1, hq, d), cos, sin), apply_rotary(k.view(-1, hkv, d), cos, sin), v.view(-1, hkv, d)


class CpuFusedOps:
    """The same steps as `EagerOps`, one C++ pass each (`torch.ops.pdserve_cpu`, built by
    `engine.kernels.cpu_build`); equal to EagerOps up to float rounding order."""

    linear = EagerOps.linear

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.pdserve_cpu.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve_cpu.silu_mul(gate_up)

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # q and k heads sit side by side in each qkv row: one in-place pass rotates both
        torch.ops.pdserve_cpu.rotary(qkv, cos[:, 0], sin[:, 0], hq + hkv, d)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)


class CpuCarryOps(CpuFusedOps):
    """`CpuFusedOps` for a bfloat16 model whose linears run as float32 GEMMs (`Linear.out_dtype`):
    norms and SiLU hand the next GEMM float32 tensors holding bf16 values, and the GEMMs that feed
    them return unrounded float32, which these ops round where the bf16 chain would
    (csrc/cpu_float_carry.cpp). Same results as CpuFusedOps, without a cast pass around each GEMM."""

    @staticmethod
    def linear(lin: Linear, x: torch.Tensor) -> torch.Tensor:
        return lin.float_out(x)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.pdserve_cpu.add_rms_norm_carry(x, residual, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve_cpu.silu_mul_carry(gate_up)

    @staticmethod
    def rotate_qk(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: the float32 GEMM output; one pass rounds it to bf16 and rotates q and k
        out = torch.ops.pdserve_cpu.rotary_carry(qkv, cos[:, 0], sin[:, 0], hq + hkv, d)
        q, k, v = out.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can hold linear weights prepacked here: CPU, a oneDNN build, and float32 or
    bfloat16 (natively where oneDNN has bf16 kernels, else through float32: `bf16_via_float32`)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.float32, torch.bfloat16)


def bf16_via_float32() -> bool:
    """Whether bfloat16 linears run faster as float32 ones here: a CPU without bf16 instructions
    (AVX2 only) has no oneDNN bf16 kernel, and torch's fallback bf16 GEMM is 4-14x slower than
    oneDNN's float32 one (measured on a 2-core AVX2 EPYC, bench-model shapes, 64-512 rows)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_values(packed: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor | None:
    """oneDNN's packed weight as a flat tensor of `count` values of `dtype` (a view of its memory, no
    copy), or None if it is not a oneDNN tensor of exactly that many bytes (oneDNN padded it)."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not packed.is_mkldnn or torch.ops.mkldnn._nbytes(packed) != nbytes:
        return None
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=dtype)


def amx_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN prepacked this bf16 weight [N, K] as `pdserve_cpu.amx_linear` reads it:
    [N/32][K/32][16][32][2], unpadded (oneDNN's choice on an AMX CPU). Compared bit for bit, once
    at load, so a oneDNN that picks another layout only loses the faster kernel."""
    n, k = weight.shape
    values = None if n % 32 or k % 32 else _packed_values(packed, torch.bfloat16, n * k)
    if values is None:
        return False
    blocks = values.view(n // 32, k // 32, 16, 32, 2)
    return torch.equal(blocks, weight.reshape(n // 32, 32, k // 32, 16, 2).permute(0, 2, 3, 1, 4))


def f32_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN prepacked this float32 weight [N, K] as `pdserve_cpu.f32_linear` reads it:
    [N/64][K][64], unpadded (oneDNN's choice on an AVX-512 CPU). Compared bit for bit, once at load,
    so a oneDNN that picks another layout only loses the faster kernel."""
    n, k = weight.shape
    values = None if n % 64 else _packed_values(packed, torch.float32, n * k)
    if values is None:
        return False
    return torch.equal(values.view(n // 64, k, 64), weight.reshape(n // 64, 64, k).transpose(1, 2))


def _kernel_takes(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, switch: str) -> bool:
    """What both linear kernels ask of a weight before its layout: their dtype, not turned off by the
    environment variable `switch`, and no bias or a contiguous [N] one of that dtype."""
    if weight.dtype != dtype or os.environ.get(switch, "1") == "0":
        return False
    return bias is None or (bias.dtype == dtype and bias.dim() == 1 and bias.is_contiguous())


def _use_f32(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
    if not _kernel_takes(weight, bias, torch.float32, "PDSERVE_F32_LINEAR"):
        return False
    return bool(torch.cpu.get_capabilities().get("avx512_f")) and f32_layout(weight, packed)


def _use_amx(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
    if not _kernel_takes(weight, bias, torch.bfloat16, "PDSERVE_AMX_LINEAR"):
        return False
    caps = torch.cpu.get_capabilities()  # cpuinfo's flags, cached by torch
    return bool(caps.get("amx_bf16") and caps.get("amx_tile")) and amx_layout(weight, packed)


class Linear:
    """y = x @ weight.T (+ bias), the weight [N, K] as a checkpoint stores it.

    With `prepack`, the weight is reordered once, at load, into oneDNN's blocked layout and only
    that copy is kept (no second copy of the weights in memory), as vLLM's CPU backend does with its
    own oneDNN build. `F.linear` otherwise goes to MKL in float32 and reorders the weight for oneDNN
    on every call in bfloat16. A bfloat16 weight on a CPU without oneDNN bf16 kernels
    (`bf16_via_float32`) is packed as float32 (exact: bf16 widens losslessly), and each call widens
    x and rounds the float32 result back to bfloat16 once, as a bf16 GEMM with float32
    accumulation does. On a CPU with AMX, native bfloat16 calls of up to `AMX_MAX_ROWS` rows run on
    `pdserve_cpu.amx_linear` over that same packed weight, and on a CPU with AVX-512 float32 calls
    of up to `F32_MAX_ROWS` rows on `pdserve_cpu.f32_linear`, likewise. Numerics: native bfloat16
    results through oneDNN are the same bits as `F.linear`'s; float32 ones (oneDNN's or the float32
    kernel's), bfloat16 through float32 and the AMX kernel's differ by summation order only (a few
    float32 ulps, so at most one bf16 rounding step).
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "in_features", "out_dtype", "amx", "f32")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.out_dtype: torch.dtype | None = None  # set: compute in float32, return this dtype
        if prepack and weight.dtype == torch.bfloat16 and bf16_via_float32():
            self.out_dtype = weight.dtype
            weight = weight.float()
            bias = bias.float() if bias is not None else None
        self.bias = bias
        self.weight: torch.Tensor | None = None if prepack else weight
        self.packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(weight) if prepack else None
        # bf16 calls of up to AMX_MAX_ROWS rows go to the AMX kernel, which reads this same packed weight
        self.amx = self.packed is not None and self.out_dtype is None and _use_amx(weight, bias, self.packed)
        # float32 calls of up to F32_MAX_ROWS rows go to the AVX-512 kernel, on this same packed weight too
        self.f32 = self.packed is not None and self.out_dtype is None and _use_f32(weight, bias, self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_dtype is not None:
            return self.float_out(x).to(self.out_dtype)
        if self.packed is not None:
            # decode steps and short chunks (2-D, rows contiguous) go to a kernel where one took the weight
            if (self.amx or self.f32) and x.dim() == 2 and x.stride(-1) == 1:
                rows = x.size(0)
                if self.amx and rows <= AMX_MAX_ROWS and cpu_build.amx_linear_ready():
                    return torch.ops.pdserve_cpu.amx_linear(x, self.packed, self.bias)
                if self.f32 and rows <= F32_MAX_ROWS and cpu_build.f32_linear_ready():
                    return torch.ops.pdserve_cpu.f32_linear(x, self.packed, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """A bf16-through-float32 linear's float32 result before its rounding to bf16 (x: bf16, or
        float32 holding bf16 values); any other linear's result as `__call__` gives it."""
        if self.out_dtype is None:
            return self(x)
        assert self.packed is not None
        x = x if x.dtype == torch.float32 else x.float()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        """Bytes of weight one call reads."""
        w = self.packed if self.packed is not None else self.weight
        assert w is not None
        return self.out_features * self.in_features * w.element_size()
