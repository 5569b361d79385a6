// Float32 vectors of L lanes (GCC vector extensions) and the loads, stores and exp that the CPU
// attention kernels share (cpu_paged_attention.cpp: decode and short chunks; cpu_prefill_attention.cpp:
// prompts). In an anonymous namespace: each translation unit keeps its own copies, inlined into its
// own per-CPU variants.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace {

// Vectors of L float32 lanes. L = 8 is one AVX2 register and the build every x86-64 CPU runs
// (target_clones); L = 16 is one AVX-512 register, for CPUs that have it (`kernels_now`). Wider
// vectors than the ISA has make GCC emulate the shuffles through memory, so the lane count is
// chosen with the ISA, not fixed.
template <int64_t L>
struct Vec {
  typedef float f32 __attribute__((vector_size(L * 4)));
  typedef uint16_t u16 __attribute__((vector_size(L * 2)));
  typedef uint32_t u32 __attribute__((vector_size(L * 4)));
  typedef int32_t i32 __attribute__((vector_size(L * 4)));
  // half a vector, in float64 (the exp's working precision)
  typedef float f32h __attribute__((vector_size(L * 2)));
  typedef double f64h __attribute__((vector_size(L * 4)));
  typedef int64_t i64h __attribute__((vector_size(L * 4)));
};
template <int64_t L> using f32v = typename Vec<L>::f32;
template <int64_t L> using i32v = typename Vec<L>::i32;

// n (<= L) values of a row as float32 lanes; the lanes past n are zero
template <int64_t L>
__attribute__((always_inline)) inline f32v<L> load_row(const float* p, int64_t n) {
  f32v<L> v = {};
  if (n == L)
    std::memcpy(&v, p, sizeof(v));
  else
    std::memcpy(&v, p, n * sizeof(float));
  return v;
}

template <int64_t L>
__attribute__((always_inline)) inline f32v<L> load_row(const at::BFloat16* p, int64_t n) {
#ifdef PDS_X86_GCC
  if constexpr (L == 16) {
    // only the AVX-512 kernels have 16 lanes. GCC lowers the generic widening below to a 256-bit
    // zero-extend, an extract and an insert per 16 values: a fifth of a bf16 item's cycles
    if (n == L) {
      typename Vec<L>::u32 bits;
      asm("vpmovzxwd %1, %0" : "=v"(bits) : "m"(*reinterpret_cast<const typename Vec<L>::u16*>(p)));
      bits <<= 16;
      return reinterpret_cast<const f32v<L>&>(bits);
    }
  }
#endif
  typename Vec<L>::u16 h = {};
  if (n == L)
    std::memcpy(&h, p, sizeof(h));
  else
    std::memcpy(&h, p, n * sizeof(uint16_t));
  const typename Vec<L>::u32 bits = __builtin_convertvector(h, typename Vec<L>::u32) << 16;  // exact widening
  return reinterpret_cast<const f32v<L>&>(bits);
}

template <int64_t L>
__attribute__((always_inline)) inline f32v<L> get(const float* p) {
  f32v<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int64_t L>
__attribute__((always_inline)) inline void put(float* p, const f32v<L>& v) {
  std::memcpy(p, &v, sizeof(v));
}

// exp of every lane, evaluated in float64 and rounded once to float32. It agrees with glibc's expf
// (what std::exp was here) on all but about 1 in 2000 inputs, those next to a rounding midpoint,
// where glibc's 0.502-ulp result is the other neighbour. A float32 polynomial (pds::fast_exp, ~1 ulp) moved
// enough probabilities by an ulp to flip a near-tie greedy token against vLLM; the scalar std::exp
// per key and query head did not vectorise. 2.5 float64 FMAs per value: cheap beside the K/V loads.
// One half of the lanes at a time: L / 2 doubles fill one register.
template <int64_t L>
__attribute__((always_inline)) inline typename Vec<L>::f32h exp_half(typename Vec<L>::f32h xf) {
  typedef typename Vec<L>::f64h f64h;
  typedef typename Vec<L>::i64h i64h;
  f64h x = __builtin_convertvector(xf, f64h);
  const f64h hi = f64h{} + 88.8, lo = f64h{} - 104.0;  // beyond: +inf and 0 in float32
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  // x = n ln 2 + r, |r| <= ln 2 / 2: n = round(x / ln 2) sits in the low bits of k's mantissa
  const double shift = 0x1.8p52;
  const f64h k = x * 1.4426950408889634 + shift;
  const f64h n = k - shift;
  const f64h r = (x - n * 0x1.62e42fefa39efp-1) - n * 0x1.abc9e3b39803fp-56;  // ln 2 in two parts
  // Taylor to r^10: relative error below 3e-13 on |r| <= 0.347. Estrin's scheme: the powers of r and
  // the pairs of terms are independent, so the chain is 5 FMAs deep, not Horner's 10; at Horner's
  // depth exp ran at the chain's latency, ~12 cycles a value (AVX2 EPYC).
  const f64h r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const f64h q0 = r + 1.0, q1 = r * (1.0 / 6) + 0.5, q2 = r * (1.0 / 120) + 1.0 / 24;
  const f64h q3 = r * (1.0 / 5040) + 1.0 / 720, q4 = r * (1.0 / 362880) + 1.0 / 40320;
  const f64h s0 = r2 * q1 + q0, s1 = r2 * q3 + q2, s2 = r2 * (1.0 / 3628800) + q4;
  const f64h p = r8 * s2 + (r4 * s1 + s0);
  const i64h e = (reinterpret_cast<const i64h&>(k) + 1023) << 52;  // the bits of 2^n
  return __builtin_convertvector(p * reinterpret_cast<const f64h&>(e), typename Vec<L>::f32h);
}

// The halves are split and joined in registers: through memory (two half-width stores, one
// full-width load) every call stalled on a failed store-to-load forward, 9% of a bf16 item's cycles.
template <int64_t L>
__attribute__((always_inline)) inline f32v<L> exp_lanes(f32v<L> x) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector; GCC 11 and older go through memory
  if constexpr (L == 8) {
    const auto lo = exp_half<8>(__builtin_shufflevector(x, x, 0, 1, 2, 3));
    const auto hi = exp_half<8>(__builtin_shufflevector(x, x, 4, 5, 6, 7));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
  } else {
    static_assert(L == 16, "8 or 16 lanes");
    const auto lo = exp_half<16>(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
    const auto hi = exp_half<16>(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
#else
  typename Vec<L>::f32h lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  lo = exp_half<L>(lo);
  hi = exp_half<L>(hi);
  std::memcpy(&x, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&x) + sizeof(lo), &hi, sizeof(hi));
  return x;
#endif
}

}  // namespace
