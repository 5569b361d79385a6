// Fused ops for a bfloat16 model whose linears run as float32 GEMMs (pdserve.engine.layers.bf16_via_float32,
// CPUs without bf16 instructions): the activations between a norm or SiLU and the next GEMM travel
// as float32 tensors that hold bf16 values, and the GEMM outputs stay unrounded float32 until the
// op that reads them (norm, SiLU, rotary) rounds them. That removes the separate bf16 <-> float32
// casts around each GEMM (seven of eight per layer), each a pass over memory and, on a machine whose
// cores are shared, a thread wake-up of milliseconds (measured on a loaded 2-core AVX2 EPYC: a
// 2-thread cast of [512, 768] took 17-23 ms against 0.1-1 ms on one thread).
//
// Numerics: every value is rounded to bf16 exactly where the eager bf16 chain (pdserve/engine/layers.py
// EagerOps with bf16 F.linear) rounds it, so results equal CpuFusedOps' bf16 ones.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu_common.h"

namespace {

using pds::b2f;
using pds::f2b;
using pds::rb;
using pds::sum_sq_bf16;

// x (bf16 stream) += rb(r): the eager add of a GEMM output cast to bf16
PDS_CLONES void add_rounded(uint16_t* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = f2b(b2f(x[i]) + rb(r[i]));
}

// y = rb(w * rb(x * inv)), stored widened
PDS_CLONES void scale_out(float* y, const uint16_t* x, const uint16_t* w, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = rb(b2f(w[i]) * rb(b2f(x[i]) * inv));
}

// y = rb(rb(silu(rb(g))) * rb(u)), in float32 chunks so that GCC vectorises each loop
PDS_CLONES void silu_mul_out(float* y, const float* g, const float* u, int64_t n) {
  float buf[256];
  for (int64_t start = 0; start < n; start += 256) {
    const int64_t len = std::min<int64_t>(256, n - start);
    for (int64_t i = 0; i < len; ++i) buf[i] = rb(g[start + i]);
    for (int64_t i = 0; i < len; ++i) buf[i] = buf[i] / (1.0f + pds::fast_exp(-buf[i]));
    for (int64_t i = 0; i < len; ++i) y[start + i] = rb(rb(buf[i]) * rb(u[start + i]));
  }
}

// y = x rounded to bf16 (the GEMM output cast)
PDS_CLONES void round_out(uint16_t* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f2b(x[i]);
}

// rotate-half of one head of rounded x into y, as cpu_fused_ops.cpp's rotary_bf16
PDS_CLONES void rotary_out(uint16_t* y, const float* x, const uint16_t* c, const uint16_t* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = rb(x[i]), x2 = rb(x[i + half]);
    y[i] = f2b(rb(x1 * b2f(c[i])) + rb(-x2 * b2f(s[i])));
    y[i + half] = f2b(rb(x2 * b2f(c[i + half])) + rb(x1 * b2f(s[i + half])));
  }
}

int64_t grain(int64_t row_len) { return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(row_len, 1)); }
uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// x [T, H] bf16 (rows contiguous) += residual.to(bf16) (residual: float32 [T, H], if given);
// returns rmsnorm(x) * weight as float32 [T, H] holding bf16 values
at::Tensor add_rms_norm_carry(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                              double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x: CPU bfloat16 [T, H] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1),
              "weight: bfloat16 [H]");
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.sizes() == x.sizes(), "residual: float32 like x");
  }
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  at::Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* xr = u16(x) + t * xs;
      if (res.defined()) add_rounded(xr, res.data_ptr<float>() + t * n, n);
      const float inv = 1.0f / std::sqrt(sum_sq_bf16(xr, n) / static_cast<float>(n) + feps);
      scale_out(y.data_ptr<float>() + t * n, xr, u16(weight), inv, n);
    }
  });
  return y;
}

// gate_up float32 [T, 2I] (a bf16 model's unrounded GEMM output) -> float32 [T, I] holding the bf16
// values of silu(gate) * up computed as in bfloat16
at::Tensor silu_mul_carry(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: CPU float32 [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gate_up.data_ptr<float>() + t * gs;
      silu_mul_out(y.data_ptr<float>() + t * n, g, g + n, n);
    }
  });
  return y;
}

// qkv float32 [T, W] (unrounded GEMM output) -> bf16 [T, W]: every value rounded, and the first
// `num_heads` heads of `head_dim` (q then k) rotated by cos/sin bf16 [T, head_dim]
at::Tensor rotary_carry(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                        int64_t head_dim) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv: CPU float32 [T, W] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "qkv [T, W] too narrow");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "cos/sin: bfloat16 [T, head_dim]");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = qkv.size(0), w = qkv.size(1), qs = qkv.stride(0), rot = num_heads * head_dim;
  at::Tensor y = at::empty({rows, w}, qkv.options().dtype(at::kBFloat16));
  at::parallel_for(0, rows, grain(w), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = qkv.data_ptr<float>() + t * qs;
      uint16_t* yr = u16(y) + t * w;
      for (int64_t h = 0; h < num_heads; ++h)
        rotary_out(yr + h * head_dim, x + h * head_dim, u16(c) + t * head_dim, u16(s) + t * head_dim, head_dim / 2);
      round_out(yr + rot, x + rot, w - rot);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("add_rms_norm_carry(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_carry(Tensor gate_up) -> Tensor");
  m.def("rotary_carry(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> Tensor");
  m.impl("rotary_carry", c10::DispatchKey::CPU, &rotary_carry);
  m.impl("add_rms_norm_carry", c10::DispatchKey::CPU, &add_rms_norm_carry);
  m.impl("silu_mul_carry", c10::DispatchKey::CPU, &silu_mul_carry);
}
