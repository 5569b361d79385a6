// Helpers shared by the CPU ops (cpu_paged_attention.cpp, cpu_fused_ops.cpp, cpu_float_carry.cpp):
// the per-CPU clone attribute, the bfloat16 <-> float32 bit conversions, a vectorisable exp and
// the bfloat16 sum of squares.
#pragma once

#include <cstdint>
#include <cstring>

// PDS_X86_GCC: GCC on x86-64, where the per-CPU variants below (clones, AVX-512 target functions and
// their inline assembly) are built; elsewhere every op compiles to its portable loops only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PDS_X86_GCC 1
#endif

// Loops marked PDS_CLONES are compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and
// baseline x86-64 (GCC) and the variant is picked at load time, so one build is correct and
// vectorised on any x86-64 CPU. v3 rather than plain "avx2": that clone had no FMA, and SiLU-mul
// ran 1.7x slower in it (measured on an AVX2-only EPYC).
#if defined(PDS_X86_GCC) && __GNUC__ >= 12
#define PDS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(PDS_X86_GCC)
// GCC 11 (Ubuntu 22.04) has no dispatcher for arch=x86-64-vN clones ("no dispatcher found for the
// versioning attributes": the whole op failed to build there); its AVX2 clone has no FMA
#define PDS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDS_CLONES
#endif

namespace pds {

#ifdef PDS_X86_GCC
// Whether this CPU runs the 16-lane (x86-64-v4, AVX-512) kernels of the attention ops: the set named
// feature by feature, since GCC 11 has no "x86-64-v4" for this builtin.
inline bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

// bfloat16 bits -> float32 (exact)
inline float b2f(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> bfloat16 bits, round to nearest even, as c10::BFloat16 does (NaN stays a quiet NaN)
inline uint16_t f2b(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// a bfloat16 store and reload: where the bf16 chain of eager ops rounds a float32 value
inline float rb(float f) { return b2f(f2b(f)); }

// The Cephes polynomial of exp on an x already clamped to [-87.34, 88.38]: exp(x) = result * 2^n, n
// set to round(x / ln 2). F: float, or a GCC vector of floats (cpu_prefill_attention.cpp's exp).
template <typename F>
__attribute__((always_inline)) inline F exp_mantissa(F x, F& n) {
  // round to nearest through the float adder: std::nearbyint is a libm call that blocks vectorising
  n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  F r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp for the vectorised loops (Cephes polynomial, ~1 ulp on the range SiLU needs); std::exp does
// not vectorise without -ffast-math
inline float fast_exp(float x) {
  x = x > 88.3762626647949f ? 88.3762626647949f : (x < -87.3365447505531f ? -87.3365447505531f : x);
  float n;
  const float p = exp_mantissa(x, n);
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// sum of squares of a bfloat16 row in one fixed order (16 lanes, then the tail, then the lanes), so
// every op that norms a row (cpu_fused_ops.cpp, cpu_float_carry.cpp) gets the same bits. Static:
// each translation unit keeps its own per-CPU clones.
static PDS_CLONES float sum_sq_bf16(const uint16_t* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += b2f(x[i + l]) * b2f(x[i + l]);
  float s = 0;
  for (; i < n; ++i) s += b2f(x[i]) * b2f(x[i]);
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

}  // namespace pds
