// Helpers shared by the CPU ops (cpu_paged_attention.cpp, cpu_fused_ops.cpp): the per-CPU
// clone attribute and the bfloat16 <-> float32 bit conversions.
#pragma once

#include <cstdint>
#include <cstring>

// Loops marked PDS_CLONES are compiled for AVX-512, AVX2 and baseline x86-64 (GCC) and the
// variant is picked at load time, so one build is correct and vectorised on any x86-64 CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PDS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDS_CLONES
#endif

namespace pds {

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

}  // namespace pds
