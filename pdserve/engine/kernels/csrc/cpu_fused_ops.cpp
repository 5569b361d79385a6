// Fused elementwise ops of the Llama decoder step on CPU: residual-add + RMSNorm, SiLU-mul, rotary.
//
// Each replaces a chain of 3-8 eager torch ops (one pass over memory each, plus temporaries) by one
// pass per row. They reproduce the torch reference of pdserve/engine/layers.py rounding step by rounding step:
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
#include <limits>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {

using pds::b2f;
using pds::f2b;
using pds::rb;
using pds::sum_sq_bf16;

// ---- per-row kernels (one row = one token) ----

inline float load_f32(const float* p) { return *p; }
inline float load_f32(const uint16_t* p) { return b2f(*p); }

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

// index of the first maximum of a row, or of its first NaN if it has one (torch.max(dim)'s answer).
// Each of 16 lanes keeps its largest value and where it first saw it (strict >: the earlier of
// equal values stays); the lanes are then merged by value, then index. GCC vector types (cpu_vec.h):
// the plain per-lane loop of this was not vectorised.
typedef f32v<16> f32x16;
typedef i32v<16> i32x16;

inline f32x16 load16(const float* p) { return get<16>(p); }
// the generic widening: cpu_vec.h's load_row<16> uses an AVX-512 instruction, and these loops are
// also built for AVX2 and baseline x86-64 (PDS_CLONES)
inline f32x16 load16(const uint16_t* p) {
  Vec<16>::u16 h;
  std::memcpy(&h, p, sizeof(h));
  const Vec<16>::u32 bits = __builtin_convertvector(h, Vec<16>::u32) << 16;  // exact widening
  return reinterpret_cast<const f32x16&>(bits);
}

template <typename T>
__attribute__((always_inline)) inline int64_t row_argmax(const T* x, int64_t n) {
  f32x16 best = f32x16{} - std::numeric_limits<float>::infinity();
  i32x16 idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, at = idx, nan = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, idx += 16) {
    const f32x16 v = load16(x + i);
    const i32x16 more = v > best;
    best = more ? v : best;
    at = more ? idx : at;
    nan |= v != v;
  }
  float m = -std::numeric_limits<float>::infinity();
  int64_t where = n;  // no lane saw a value above -inf: an all -inf row's answer is 0, below
  bool any_nan = false;
  for (int l = 0; l < 16; ++l) {
    any_nan |= nan[l] != 0;
    if (best[l] > m || (best[l] == m && at[l] < where)) m = best[l], where = at[l];
  }
  for (; i < n; ++i) {
    const float v = load_f32(x + i);
    any_nan |= v != v;
    if (v > m) m = v, where = i;
  }
  if (any_nan)
    for (int64_t j = 0; j < n; ++j)
      if (load_f32(x + j) != load_f32(x + j)) return j;
  return where < n ? where : 0;
}
PDS_CLONES int64_t row_argmax_f32(const float* x, int64_t n) { return row_argmax(x, n); }
PDS_CLONES int64_t row_argmax_bf16(const uint16_t* x, int64_t n) { return row_argmax(x, n); }

// ---- ops ----

// Rows per thread chunk: about 32K values, so a decode step's rows (16-128 tokens) are split between
// the threads too. The threads are awake then, spinning after the GEMM before; a grain of 256K values
// ran every decode step's SiLU-mul and RMSNorm on one core, and the engine_vs_vllm bf16 workload took
// 1-2% longer (2-core Sapphire Rapids). A single row (batch-1 decode) still runs on one thread.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_len, 1)); }

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

// logits [S, V] -> int64 [S]: each row's greedy token, as logits.max(dim=-1).indices. Reads bfloat16
// logits as they are: torch's widening copy and its bf16 max each cost about as much as the max of
// the float32 copy.
at::Tensor greedy(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits [S, V] expected");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
  const int64_t rows = logits.size(0), n = logits.size(1), ls = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      o[t] = is_bf16(logits) ? row_argmax_bf16(u16(logits) + t * ls, n)
                            : row_argmax_f32(logits.data_ptr<float>() + t * ls, n);
  });
  return out;
}

// In place on float32 logits [S, V]: for each row r in `rows`, every token whose bit in bitmask[r] is 0
// gets -inf (xgrammar's layout: int32 words [S, ceil(V / 32)], bit v % 32 of word v / 32, 1 = allowed).
// An all-ones word is skipped whole and the rest is a branch-free select; xgrammar's own CPU kernel
// took 3.5 ms on [32, 32000] (2-core Xeon), a few percent of a structured decode step.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat, "logits must be float32 on CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits [S, V] with contiguous rows expected");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "bitmask: contiguous int32 [S, ceil(V / 32)] expected");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [R]");
  at::Tensor r = rows.contiguous();
  const int64_t* ri = r.data_ptr<int64_t>();
  const int64_t count = r.size(0), n = logits.size(1), ls = logits.stride(0), words = bitmask.size(1);
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ri[i] >= 0 && ri[i] < logits.size(0), "row ", ri[i], " out of range");
  const uint32_t* bm = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* lg = logits.data_ptr<float>();
  const float neg = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, count, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t* w = bm + ri[i] * words;
      float* x = lg + ri[i] * ls;
      for (int64_t base = 0; base < n; base += 32) {
        const uint32_t bits = w[base / 32];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t lim = std::min<int64_t>(32, n - base);
        for (int64_t j = 0; j < lim; ++j)  // branch-free: a select the compiler vectorizes
          x[base + j] = ((bits >> j) & 1u) ? x[base + j] : neg;
      }
    }
  });
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
  m.def("greedy(Tensor logits) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
  m.impl("greedy", c10::DispatchKey::CPU, &greedy);
  m.impl("apply_token_bitmask", c10::DispatchKey::CPU, &apply_token_bitmask);
}
