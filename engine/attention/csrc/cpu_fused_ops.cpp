// Fused elementwise ops of the Llama decoder step on CPU: residual-add + RMSNorm, SiLU-mul, rotary.
//
// Each replaces a chain of 3-8 eager torch ops (one pass over memory each, plus temporaries) by one
// pass per row. They reproduce the torch reference of engine/layers.py rounding step by rounding step:
// float32 math, and in bfloat16 a rounding to bfloat16 wherever the eager chain stores a bf16
// intermediate, so bf16 results match the eager path to the ulp.
//
// Vectorisation: plain loops that GCC vectorises, compiled for AVX-512, AVX2 and baseline x86-64
// and picked at load (target_clones), as in cpu_paged_attention.cpp. at::vec would compile to its
// scalar fallback here, since a cpp_extension build has one set of flags for every CPU.
// fp-contract=off keeps a*b + c*d from becoming an FMA, so float32 results equal eager torch's.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace {

using pds::b2f;
using pds::f2b;
using pds::rb;
using pds::sum_sq_bf16;

// ---- per-row kernels (one row = one token) ----

PDS_CLONES float sum_sq_f32(const float* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[i + l] * x[i + l];
  float s = 0;
  for (; i < n; ++i) s += x[i] * x[i];
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

PDS_CLONES void add_f32(float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += r[i];
}
PDS_CLONES void add_bf16(uint16_t* x, const uint16_t* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = f2b(b2f(x[i]) + b2f(r[i]));
}

// y = w * (x * inv_rms), with the eager path's cast of x * inv_rms back to the input dtype
PDS_CLONES void scale_f32(float* y, const float* x, const float* w, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}
PDS_CLONES void scale_bf16(uint16_t* y, const uint16_t* x, const uint16_t* w, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f2b(b2f(w[i]) * rb(b2f(x[i]) * inv));
}

// silu(g) * u = g / (1 + exp(-g)) * u
PDS_CLONES void silu_mul_f32(float* y, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + pds::fast_exp(-g[i])) * u[i];
}
// in float32 chunks: GCC does not vectorise the one-loop form (bf16 widening, exp and narrowing)
PDS_CLONES void silu_mul_bf16(uint16_t* y, const uint16_t* g, const uint16_t* u, int64_t n) {
  float buf[256];
  for (int64_t start = 0; start < n; start += 256) {
    const int64_t len = std::min<int64_t>(256, n - start);
    for (int64_t i = 0; i < len; ++i) buf[i] = b2f(g[start + i]);
    for (int64_t i = 0; i < len; ++i) buf[i] = buf[i] / (1.0f + pds::fast_exp(-buf[i]));
    for (int64_t i = 0; i < len; ++i) y[start + i] = f2b(rb(buf[i]) * b2f(u[start + i]));
  }
}

// rotate-half: [x1, x2] -> [x1*c1 - x2*s1, x2*c2 + x1*s2] over one head of `2 * half` values
PDS_CLONES void rotary_f32(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] + (-x2) * s[i];
    x[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}
PDS_CLONES void rotary_bf16(uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = b2f(x[i]), x2 = b2f(x[i + half]);
    x[i] = f2b(rb(x1 * b2f(c[i])) + rb(-x2 * b2f(s[i])));
    x[i + half] = f2b(rb(x2 * b2f(c[i + half])) + rb(x1 * b2f(s[i + half])));
  }
}

// ---- ops ----

// Rows per thread chunk: about 256K values. These passes take microseconds below that, and waking
// the other OpenMP threads can cost a scheduler time slice (milliseconds) on a loaded machine.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(row_len, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have contiguous rows");
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// x [T, H] (rows contiguous) += residual (if given); returns rmsnorm(x) * weight as a new [T, H]
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [T,H], weight [H] expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: x's dtype, contiguous");
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must be like x");
  }
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (is_bf16(x)) {
        uint16_t* xr = u16(x) + t * xs;
        if (res.defined()) add_bf16(xr, u16(res) + t * n, n);
        const float inv = 1.0f / std::sqrt(sum_sq_bf16(xr, n) / static_cast<float>(n) + feps);
        scale_bf16(u16(y) + t * n, xr, u16(weight), inv, n);
      } else {
        float* xr = x.data_ptr<float>() + t * xs;
        if (res.defined()) add_f32(xr, res.data_ptr<float>() + t * n, n);
        const float inv = 1.0f / std::sqrt(sum_sq_f32(xr, n) / static_cast<float>(n) + feps);
        scale_f32(y.data_ptr<float>() + t * n, xr, weight.data_ptr<float>(), inv, n);
      }
    }
  });
  return y;
}

// gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:]  as [T, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I] expected");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (is_bf16(gate_up)) {
        const uint16_t* g = u16(gate_up) + t * gs;
        silu_mul_bf16(u16(y) + t * n, g, g + n, n);
      } else {
        const float* g = gate_up.data_ptr<float>() + t * gs;
        silu_mul_f32(y.data_ptr<float>() + t * n, g, g + n, n);
      }
    }
  });
  return y;
}

// In place on qkv [T, W]: rotates the first `num_heads` heads of `head_dim` of each row (q then k
// heads, v left alone) by cos/sin [T, head_dim].
void rotary(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "qkv [T, W] too narrow");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim,
              "cos/sin [T, head_dim] expected");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin dtype");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = qkv.size(0), qs = qkv.stride(0), half = head_dim / 2;
  at::parallel_for(0, rows, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < num_heads; ++h) {
        if (is_bf16(qkv))
          rotary_bf16(u16(qkv) + t * qs + h * head_dim, u16(c) + t * head_dim, u16(s) + t * head_dim, half);
        else
          rotary_f32(qkv.data_ptr<float>() + t * qs + h * head_dim, c.data_ptr<float>() + t * head_dim,
                     s.data_ptr<float>() + t * head_dim, half);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}
