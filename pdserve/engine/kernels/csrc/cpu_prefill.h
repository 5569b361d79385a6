// The prompt attention kernels (cpu_prefill_attention.cpp, cpu_amx_prefill.cpp), called from the op entry in
// cpu_paged_attention.cpp, which checks the inputs first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pds {

// Sequences whose query tokens are many (fresh prompts, long chunks after a cached prefix), over
// their K/V pages in the pool kv[N, P, Hkv, B, D] (P = 2: K, V; P = 1: MLA, the V rows are the K rows).
// Inputs as for paged_attention; out is [T, Hq, D].
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
  int64_t planes;  // kv.size(1)
  const float* sinks;  // [hq]: a logit per query head in its softmax denominator only (gpt-oss); null: none
};

// Whether this CPU and head size run the kernel: AVX-512 and D a multiple of 16 (up to 256).
bool prefill_supported(int64_t d);
void prefill_attention_f32(const PrefillProblem& pb);
void prefill_attention_bf16(const PrefillProblem& pb);

// The bf16 prompt kernel on AMX tiles (cpu_amx_prefill.cpp): where this process may use AMX
// (`amx_ready`) and D is a multiple of 32 up to 256.
bool amx_prefill_supported(int64_t d);
void prefill_attention_amx(const PrefillProblem& pb);

// Query rows [row0, row_end) of one sequence's kv head group (row r: token r / g, query head
// head * g + r % g) and the keys they see, positions lo .. max_pos.
struct RowSpan {
  int32_t seq, head, row0, row_end;
  int64_t lo, max_pos;
};

// Every group's rows cut into spans of `span_rows(group rows)` rows each, in (sequence, kv head, rows)
// order, so that a thread's next span reads the same pages; `cost_before` gets each span's start in the
// running cost (rows x keys), for `cost_bounds`.
template <typename SpanRows>
std::vector<RowSpan> row_spans(const PrefillProblem& pb, SpanRows span_rows, std::vector<int64_t>& cost_before) {
  const int64_t g = pb.hq / pb.hkv;
  std::vector<RowSpan> spans;
  cost_before.assign(1, 0);
  for (int64_t s = 0; s < pb.num_seqs; ++s) {
    const int64_t q_len = pb.qstart[s + 1] - pb.qstart[s], first_pos = pb.ctx[s] - q_len, rows = q_len * g;
    const int64_t step = rows > 0 ? span_rows(rows) : 1;
    for (int64_t h = 0; h < pb.hkv; ++h)
      for (int64_t row0 = 0; row0 < rows; row0 += step) {
        const int64_t row_end = std::min(rows, row0 + step);
        const int64_t min_pos = first_pos + row0 / g, max_pos = first_pos + (row_end - 1) / g;
        const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, min_pos - pb.window + 1) : 0;
        spans.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(row0),
                         static_cast<int32_t>(row_end), lo, max_pos});
        cost_before.push_back(cost_before.back() + (row_end - row0) * (max_pos - lo + 1));
      }
  }
  return spans;
}

// Boundaries of runs of consecutive work items of about equal cost, one run per thread at most:
// cost_before[i] is the cost of items [0, i) (items + 1 entries), and run r is items [bounds[r],
// bounds[r + 1]). A run costs at least about 2^14 units (rows x keys: ~2^20 multiply-adds per head
// dimension), since waking a thread costs microseconds.
inline std::vector<int64_t> cost_bounds(const std::vector<int64_t>& cost_before, int64_t threads) {
  const int64_t total = cost_before.back(), items = static_cast<int64_t>(cost_before.size()) - 1;
  const int64_t ranges = std::clamp<int64_t>(total / (int64_t{1} << 14), 1, threads);
  std::vector<int64_t> bounds(ranges + 1);
  for (int64_t r = 0; r <= ranges; ++r)
    bounds[r] = std::lower_bound(cost_before.begin(), cost_before.end() - 1, total * r / ranges) - cost_before.begin();
  bounds[ranges] = items;
  return bounds;
}

}  // namespace pds
