// The prompt attention kernels (cpu_prefill_attention.cpp, cpu_amx_prefill.cpp), called from the op entry in
// cpu_paged_attention.cpp, which checks the inputs first.
#pragma once

#include <cstdint>

namespace pds {

// Sequences whose query tokens are many (fresh prompts, long chunks after a cached prefix), over
// their K/V pages in the pool kv[N, 2, Hkv, B, D]. Inputs as for paged_attention; out is [T, Hq, D].
struct PrefillProblem {
  const void* q;
  int64_t q_row;  // elements from one query token's row to the next
  const void* kv;
  void* out;
  const int32_t* table;  // [num_seqs, max_pages]
  const int32_t* qstart;  // [num_seqs + 1]
  const int32_t* ctx;     // [num_seqs]
  int64_t num_seqs, hq, hkv, d, bs, max_pages, window;
  float scale;
};

// Whether this CPU and head size run the kernel: AVX-512 and D a multiple of 16 (up to 256).
bool prefill_supported(int64_t d);
void prefill_attention_f32(const PrefillProblem& pb);
void prefill_attention_bf16(const PrefillProblem& pb);

// The bf16 prompt kernel on AMX tiles (cpu_amx_prefill.cpp): where this process may use AMX
// (`amx_ready`) and D is a multiple of 32 up to 256.
bool amx_prefill_supported(int64_t d);
void prefill_attention_amx(const PrefillProblem& pb);

// Whether this process may use AMX bf16 tiles (cpu_amx_linear.cpp): the CPU has them and Linux
// granted the tile state.
bool amx_ready();

}  // namespace pds
