// Paged attention on CPU that reads K/V pages of the pool in place.
//
// Pool layer layout (HND inside a block): kv[N, 2, Hkv, B, D].
// For every sequence s, its query tokens q[query_start[s] .. query_start[s+1])
// sit at the last positions of its context (context_lens[s]); query j attends
// causally to keys 0 .. ctx - q_len + j, found through block_table[s]; with a sliding window W > 0
// (Mistral) only to the last W of them, its own included (Hugging Face: key > query - W).
//
// One work item is (query token, kv head): the group's Hq/Hkv query heads share each K/V row
// read. It runs in three passes over its keys (see `attend`): the scores, L keys at a time from
// one page (the L keys' dot products are L independent FMA chains over the head dimension, summed
// into one vector of scores by a shuffle tree); the softmax numerators from the exact maximum, with
// a vectorised exp; and the values weighted by them, a page at a time, a query head's accumulator
// held in registers for head sizes 32, 64 and 128. Each pass asks for the next page of the
// sequence ahead of its use, since it can be anywhere in the pool.
// Measured on an AVX2 EPYC (BENCHMARKS.md): a 120-sequence decode step's attention over ~350
// keys each, 2 threads, fell by about a fifth (~95 to ~75 ms) with the three passes (one
// online-softmax loop before, whose max -> exp -> rescale chain ran at its latency from one chunk
// to the next).

// The vector code uses GCC vector extensions, so it compiles to whatever the clone's ISA has:
// on x86-64 with GCC the item function is built for AVX-512, AVX2 and baseline and picked at
// load time (target_clones), so one build is correct on any x86-64 CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

// 8 lanes: one AVX2 register (half an AVX-512 one). Wider vectors than the ISA has make GCC
// emulate the shuffles through memory, and the machines we run on include AVX2-only ones.
constexpr int64_t L = 8;  // lanes of a vector, and keys per chunk
typedef float f32xL __attribute__((vector_size(L * 4)));
typedef uint16_t u16xL __attribute__((vector_size(L * 2)));
typedef uint32_t u32xL __attribute__((vector_size(L * 4)));
typedef int32_t i32xL __attribute__((vector_size(L * 4)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));

// n (<= L) values of a row as float32 lanes; the lanes past n are zero
__attribute__((always_inline)) inline f32xL load_row(const float* p, int64_t n) {
  f32xL v = {};
  if (n == L)
    std::memcpy(&v, p, sizeof(v));
  else
    std::memcpy(&v, p, n * sizeof(float));
  return v;
}

__attribute__((always_inline)) inline f32xL load_row(const at::BFloat16* p, int64_t n) {
  u16xL h = {};
  if (n == L)
    std::memcpy(&h, p, sizeof(h));
  else
    std::memcpy(&h, p, n * sizeof(uint16_t));
  const u32xL bits = __builtin_convertvector(h, u32xL) << 16;  // bfloat16 -> float32 is exact
  return reinterpret_cast<const f32xL&>(bits);
}

// lane k of the result = the sum of the L lanes of v[k]
__attribute__((always_inline)) inline f32xL sum_lanes_of_each(const f32xL* v) {
#if defined(__GNUC__) && !defined(__clang__)
  // each level adds the two halves of every partial sum, packing two inputs into one output
  const i32xL lo1 = {0, 1, 2, 3, 8, 9, 10, 11};
  const i32xL hi1 = lo1 + 4;
  const i32xL lo2 = {0, 1, 4, 5, 8, 9, 12, 13};
  const i32xL hi2 = lo2 + 2;
  const i32xL lo3 = {0, 2, 4, 6, 8, 10, 12, 14};
  const i32xL hi3 = lo3 + 1;
  f32xL a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  return __builtin_shuffle(b[0], b[1], lo3) + __builtin_shuffle(b[0], b[1], hi3);
#else
  f32xL out = {};
  for (int k = 0; k < L; ++k)
    for (int l = 0; l < L; ++l) out[k] += v[k][l];
  return out;
#endif
}

// What every work item of one call reads.
struct Problem {
  const void* q;
  int64_t q_row;  // q may be a row view of the fused qkv projection
  const void* kv;
  void* out;
  const int32_t* table;
  const int32_t* qstart;
  const int32_t* ctx;
  const int32_t* seq_of;  // token -> sequence
  int64_t hq, hkv, d, bs, max_pages, window;
  float scale;
};

// Per-thread buffers, sized once per parallel chunk (`scores` grows to the longest item's keys).
// Vectors are kept in plain float storage and moved with memcpy (unaligned loads): a std::vector of
// a vector type is not reliably aligned.
struct Scratch {
  std::vector<float> q, acc;  // [group][d rounded up to L]
  std::vector<float> scores;  // [group][stride]: the item's scores, then its softmax numerators
  std::vector<float> max;     // [group][L]: the largest score seen, per lane
  std::vector<float> inv;     // [group]: 1 / the sum of the numerators
  Scratch(int64_t group, int64_t vecs) : q(group * vecs * L), acc(group * vecs * L), max(group * L), inv(group) {}
};

__attribute__((always_inline)) inline f32xL get(const float* p) {
  f32xL v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void put(float* p, const f32xL& v) { std::memcpy(p, &v, sizeof(v)); }

// exp of every lane, evaluated in float64 and rounded once to float32. It agrees with glibc's expf
// (what std::exp was here) on all but about 1 in 2000 inputs, those next to a rounding midpoint,
// where glibc's 0.502-ulp result is the other neighbour. A float32 polynomial (pds::fast_exp, ~1 ulp) moved
// enough probabilities by an ulp to flip a near-tie greedy token against vLLM; the scalar std::exp
// per key and query head did not vectorise. 2.5 float64 FMAs per value: cheap beside the K/V loads.
__attribute__((always_inline)) inline f32x4 exp_half(f32x4 xf) {
  f64x4 x = __builtin_convertvector(xf, f64x4);
  const f64x4 hi = f64x4{} + 88.8, lo = f64x4{} - 104.0;  // beyond: +inf and 0 in float32
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  // x = n ln 2 + r, |r| <= ln 2 / 2: n = round(x / ln 2) sits in the low bits of k's mantissa
  const double shift = 0x1.8p52;
  const f64x4 k = x * 1.4426950408889634 + shift;
  const f64x4 n = k - shift;
  const f64x4 r = (x - n * 0x1.62e42fefa39efp-1) - n * 0x1.abc9e3b39803fp-56;  // ln 2 in two parts
  // Taylor to r^10: relative error below 3e-13 on |r| <= 0.347. Estrin's scheme: the powers of r and
  // the pairs of terms are independent, so the chain is 5 FMAs deep, not Horner's 10; at Horner's
  // depth exp ran at the chain's latency, ~12 cycles a value (AVX2 EPYC).
  const f64x4 r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const f64x4 q0 = r + 1.0, q1 = r * (1.0 / 6) + 0.5, q2 = r * (1.0 / 120) + 1.0 / 24;
  const f64x4 q3 = r * (1.0 / 5040) + 1.0 / 720, q4 = r * (1.0 / 362880) + 1.0 / 40320;
  const f64x4 s0 = r2 * q1 + q0, s1 = r2 * q3 + q2, s2 = r2 * (1.0 / 3628800) + q4;
  const f64x4 p = r8 * s2 + (r4 * s1 + s0);
  const i64x4 e = (reinterpret_cast<const i64x4&>(k) + 1023) << 52;  // the bits of 2^n
  return __builtin_convertvector(p * reinterpret_cast<const f64x4&>(e), f32x4);
}

__attribute__((always_inline)) inline f32xL exp_lanes(f32xL x) {
  f32x4 lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  lo = exp_half(lo);
  hi = exp_half(hi);
  std::memcpy(&x, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&x) + sizeof(lo), &hi, sizeof(hi));
  return x;
}

// the L lanes' scores of one chunk: lane j = q . k[j] for the chunk's n keys (FULL: n == L).
// The c loop is outside the j loop so that the L partial sums are L independent FMA chains: with j
// outside, each key's sum was one chain of d / L dependent FMAs, and the loop ran at FMA latency.
template <typename T, bool FULL>
__attribute__((always_inline)) inline f32xL chunk_scores(const float* qg, const T* krows, int64_t n, int64_t d,
                                                         int64_t vecs, int64_t tail) {
  f32xL partial[L] = {};
  for (int64_t c = 0; c < vecs; ++c) {
    const f32xL qv = get(qg + c * L);
    const int64_t w = c == vecs - 1 ? tail : L;
    for (int64_t j = 0; j < (FULL ? L : n); ++j) partial[j] += qv * load_row(krows + j * d + c * L, w);
  }
  return sum_lanes_of_each(partial);
}

// acc[0 .. d) += sum over n keys of p[j] * v[j]. VECS > 0: d == VECS * L, and the accumulator is held
// in VECS registers (VECS independent FMA chains); 0: any d, in memory.
template <typename T, int64_t VECS>
__attribute__((always_inline)) inline void add_values(float* acc, const float* p, const T* vrows, int64_t n,
                                                      int64_t d, int64_t vecs, int64_t tail) {
  if constexpr (VECS > 0) {
    f32xL a[VECS];
    for (int64_t c = 0; c < VECS; ++c) a[c] = get(acc + c * L);
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      for (int64_t c = 0; c < VECS; ++c) a[c] += pj * load_row(vrows + j * d + c * L, L);
    }
    for (int64_t c = 0; c < VECS; ++c) put(acc + c * L, a[c]);
  } else {
    for (int64_t c = 0; c < vecs; ++c) {
      const int64_t w = c == vecs - 1 ? tail : L;
      f32xL a = get(acc + c * L);
      for (int64_t j = 0; j < n; ++j) a += p[j] * load_row(vrows + j * d + c * L, w);
      put(acc + c * L, a);
    }
  }
}

// Ask for the `bytes` at `p` (one head's rows of the next page: the pages of a sequence are anywhere
// in the pool, so the hardware prefetcher does not follow from one to the next).
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

// One work item in three passes over its keys: every key's scores (K pages), the softmax numerators
// from the exact maximum (one vectorised exp loop), and the values weighted by them (V pages). An
// online softmax fused the three per chunk of keys, and its max -> exp -> sum -> rescale chain ran
// serially from one chunk to the next, at that chain's latency; apart, each pass's iterations are
// independent. The scores of an item are group x keys floats of per-thread scratch.
template <typename T, int64_t VECS>
__attribute__((always_inline)) inline void attend(const Problem& pb, int64_t item, Scratch& sc) {
  const int64_t hkv = pb.hkv, d = pb.d, bs = pb.bs, group = pb.hq / hkv;
  const int64_t vecs = VECS > 0 ? VECS : (d + L - 1) / L, tail = d - (vecs - 1) * L;
  const int64_t t = item / hkv, h = item % hkv, s = pb.seq_of[t];
  const int64_t q_len = pb.qstart[s + 1] - pb.qstart[s];
  const int64_t end_key = pb.ctx[s] - q_len + (t - pb.qstart[s]) + 1;  // causal: keys 0 .. own position
  const int64_t first = pb.window > 0 ? std::max<int64_t>(0, end_key - pb.window) : 0;
  // a query head's row of scores: the keys rounded up to pass 2's step of two vectors, and room for
  // the last chunk's full-width store (a chunk can start anywhere in a vector when a page or the
  // window cuts the one before it short)
  const int64_t keys = end_key - first, padded = (keys + 2 * L - 1) / (2 * L) * (2 * L), stride = padded + L;
  const int32_t* pages = pb.table + s * pb.max_pages;
  const T* qp = static_cast<const T*>(pb.q);
  const T* kvp = static_cast<const T*>(pb.kv);
  // strides of kv[N, 2, Hkv, B, D] (contiguous)
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = 2 * s_kv;
  const int64_t page_bytes = s_head * static_cast<int64_t>(sizeof(T));
  const i32xL lane = {0, 1, 2, 3, 4, 5, 6, 7};
  if (static_cast<int64_t>(sc.scores.size()) < group * stride) sc.scores.resize(group * stride);
  float* scores = sc.scores.data();
  const auto head_rows = [&](int64_t key) { return kvp + pages[key / bs] * s_block + h * s_head + key % bs * d; };

  for (int64_t g = 0; g < group; ++g) {
    const T* row = qp + t * pb.q_row + (h * group + g) * d;
    for (int64_t c = 0; c < vecs; ++c)
      put(&sc.q[(g * vecs + c) * L], load_row(row + c * L, c == vecs - 1 ? tail : L) * pb.scale);
    std::fill_n(&sc.acc[g * vecs * L], vecs * L, 0.0f);
    put(&sc.max[g * L], f32xL{} - INFINITY);
  }
  // 1. scores, L keys at a time from one page; the lanes past the chunk's keys are -inf. The next
  // page is asked for when a page is started, so that this page's work hides its latency.
  for (int64_t key = first; key < end_key;) {
    const int64_t off = key % bs;
    const int64_t n = std::min({end_key - key, bs - off, L});
    const T* krows = head_rows(key);
    if ((off == 0 || key == first) && key - off + bs < end_key) prefetch(head_rows(key - off + bs), page_bytes);
    const i32xL live = lane < static_cast<int32_t>(n);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = &sc.q[g * vecs * L];
      f32xL sv = n == L ? chunk_scores<T, true>(qg, krows, n, d, vecs, tail)
                        : chunk_scores<T, false>(qg, krows, n, d, vecs, tail);
      sv = live ? sv : f32xL{} - INFINITY;
      put(scores + g * stride + (key - first), sv);
      const f32xL mx = get(&sc.max[g * L]);
      put(&sc.max[g * L], sv > mx ? sv : mx);
    }
    key += n;
  }
  // 2. numerators exp(score - max) in place, and their sum. A chunk cut short by a page end wrote
  // -inf past its keys, which the next chunk overwrites, so the row is dense up to `keys`; past it
  // the lanes are masked to 0.
  for (int64_t g = 0; g < group; ++g) {
    const f32xL mv = get(&sc.max[g * L]);
    float mx = mv[0];
    for (int64_t j = 1; j < L; ++j) mx = mv[j] > mx ? mv[j] : mx;
    float* row = scores + g * stride;
    // two vectors a step: their exps are independent chains the core can overlap
    f32xL total[2] = {};
    for (int64_t k = 0; k < padded; k += 2 * L) {
      for (int64_t u = 0; u < 2; ++u) {
        const i32xL live = lane < static_cast<int32_t>(keys - k - u * L);
        const f32xL p = live ? exp_lanes(get(row + k + u * L) - mx) : f32xL{};
        put(row + k + u * L, p);
        total[u] += p;
      }
    }
    const f32xL both = total[0] + total[1];
    float sum = 0.0f;
    for (int64_t j = 0; j < L; ++j) sum += both[j];
    sc.inv[g] = 1.0f / sum;
  }
  // 3. values: a page's rows at a time (the next page asked for first), each query head's
  // accumulator in registers across them
  for (int64_t key = first; key < end_key;) {
    const int64_t off = key % bs;
    const int64_t n = std::min(end_key - key, bs - off);
    const T* vrows = head_rows(key) + s_kv;
    if (key + n < end_key) prefetch(head_rows(key + n) + s_kv, page_bytes);
    for (int64_t g = 0; g < group; ++g)
      add_values<T, VECS>(&sc.acc[g * vecs * L], scores + g * stride + (key - first), vrows, n, d, vecs, tail);
    key += n;
  }
  T* op = static_cast<T*>(pb.out);
  for (int64_t g = 0; g < group; ++g) {
    const float* acc = &sc.acc[g * vecs * L];
    T* dst = op + (t * pb.hq + h * group + g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i] * sc.inv[g]);
  }
}

// Head sizes 32, 64 and 128 keep a query head's accumulator in registers; any other size takes the
// general path. Inlined into one clone set per element type (below).
template <typename T>
__attribute__((always_inline)) inline void attend_items(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  switch (pb.d) {
    case 4 * L:
      for (int64_t i = begin; i < end; ++i) attend<T, 4>(pb, i, sc);
      break;
    case 8 * L:
      for (int64_t i = begin; i < end; ++i) attend<T, 8>(pb, i, sc);
      break;
    case 16 * L:
      for (int64_t i = begin; i < end; ++i) attend<T, 16>(pb, i, sc);
      break;
    default:
      for (int64_t i = begin; i < end; ++i) attend<T, 0>(pb, i, sc);
  }
}

PDS_CLONES void attend_items_f32(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  attend_items<float>(pb, begin, end, sc);
}
PDS_CLONES void attend_items_bf16(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  attend_items<at::BFloat16>(pb, begin, end, sc);
}

// Every page an item will read, checked before any is: a bad index would read outside the pool,
// and a bad context size the scratch rows by. O(pages), against O(pages x rows) of work. Called
// from the op's entry with the other checks (all its inputs contiguous).
void check_pages(const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& context_lens,
                 int64_t num_tokens, int64_t num_blocks, int64_t bs) {
  const int64_t num_seqs = context_lens.size(0), max_pages = block_table.size(1);
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  TORCH_CHECK(qstart[0] == 0 && qstart[num_seqs] == num_tokens, "query_start must run from 0 to the ", num_tokens,
              " query tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t{qstart[s + 1]} - qstart[s], pages = (int64_t{ctx[s]} + bs - 1) / bs;
    TORCH_CHECK(q_len >= 0 && qstart[s + 1] <= num_tokens && ctx[s] >= q_len && pages <= max_pages, "sequence ", s,
                ": ", q_len, " query tokens and ", ctx[s], " context tokens do not fit its ", max_pages, " pages of ",
                bs);
    for (int64_t p = 0; p < pages; ++p)
      TORCH_CHECK(table[s * max_pages + p] >= 0 && table[s * max_pages + p] < num_blocks, "sequence ", s, " page ",
                  p, ": block ", table[s * max_pages + p], " is not in the pool of ", num_blocks);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& query_start,
         const at::Tensor& context_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_tokens = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(2), bs = kv.size(3);
  const int64_t num_seqs = context_lens.size(0);
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int64_t max_pages = block_table.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  // each query token's sequence (work items are flat over (token, kv head)) and the keys of the
  // tokens before it (the cost of the items up to it); `check_pages` has vetted the indices
  std::vector<int32_t> seq_of(num_tokens);
  std::vector<int64_t> keys_before(num_tokens + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int32_t t = qstart[s]; t < qstart[s + 1]; ++t) {
      seq_of[t] = static_cast<int32_t>(s);
      const int64_t keys = ctx[s] - (qstart[s + 1] - t) + 1;
      keys_before[t + 1] = keys_before[t] + (window > 0 ? std::min<int64_t>(keys, window) : keys);
    }
  }
  const Problem pb{q.data_ptr<T>(), q.stride(0), kv.data_ptr<T>(), out.data_ptr<T>(),
                   table, qstart, ctx, seq_of.data(), hq, hkv, d, bs, max_pages, window, static_cast<float>(scale)};
  // One contiguous range of items per thread, of about equal keys: contexts differ from one
  // sequence to the next, and equal item counts left one thread waiting for the other at the end.
  // A range reads at least about 256K K/V values: a batch-1 decode step reads far fewer, and waking
  // the other OpenMP threads can cost a scheduler time slice on a loaded machine.
  const int64_t num_items = num_tokens * hkv, total = keys_before[num_tokens] * hkv;
  const int64_t ranges = std::clamp<int64_t>(2 * d * total / (int64_t{1} << 18), 1, at::get_num_threads());
  // the first item whose keys before it (over all items) reach `target`
  const auto first_item_at = [&](int64_t target) {
    int64_t lo = 0, hi = num_items;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2, t = mid / hkv;
      const int64_t before = keys_before[t] * hkv + (mid % hkv) * (keys_before[t + 1] - keys_before[t]);
      if (before < target) lo = mid + 1; else hi = mid;
    }
    return lo;
  };
  std::vector<int64_t> bounds(ranges + 1);  // range r is items [bounds[r], bounds[r + 1])
  for (int64_t r = 0; r <= ranges; ++r) bounds[r] = first_item_at(total * r / ranges);
  at::parallel_for(0, ranges, 1, [&](int64_t first_range, int64_t end_range) {
    Scratch sc(hq / hkv, (d + L - 1) / L);
    for (int64_t r = first_range; r < end_range; ++r) {
      if constexpr (std::is_same_v<T, float>)
        attend_items_f32(pb, bounds[r], bounds[r + 1], sc);
      else
        attend_items_bf16(pb, bounds[r], bounds[r + 1], sc);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                           const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                           int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "cpu_paged attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(1) == 2, "q [T,Hq,D], kv [N,2,Hkv,B,D] expected");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(q.size(2) == kv.size(4) && q.size(1) % kv.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt, "index tensors must be int32");
  TORCH_CHECK(kv.is_contiguous(), "kv layer must be contiguous");
  TORCH_CHECK(window >= 0, "sliding window must be >= 0 (0: none)");
  TORCH_CHECK(block_table.dim() == 2 && context_lens.dim() == 1 && block_table.size(0) == context_lens.size(0) &&
                  query_start.numel() == context_lens.size(0) + 1,
              "block_table [S, P] and query_start [S + 1] must match context_lens [S]");
  // a view with contiguous heads (a slice of the qkv projection) is read in place
  at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  at::Tensor bt = block_table.contiguous(), qs = query_start.contiguous(), cl = context_lens.contiguous();
  check_pages(bt, qs, cl, q.size(0), kv.size(0), kv.size(3));
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(qc, kv, bt, qs, cl, scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(qc, kv, bt, qs, cl, scale, window, out);
  } else {
    TORCH_CHECK(false, "cpu_paged attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// kv[slot_blocks[t], 0/1, :, slot_offsets[t]] = k[t] / v[t] for every new token t. One serial
// pass of row copies: torch's advanced-index assignment costs two parallel index_put_ per layer.
void store_kv(at::Tensor kv, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_blocks,
              const at::Tensor& slot_offsets) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous(), "kv [N,2,Hkv,B,D] contiguous expected");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv.size(2) && k.size(2) == kv.size(4),
              "k/v [T,Hkv,D] matching the pool expected");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(), "k/v dtype differs");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v rows must be contiguous");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0), "int64 slots [T] expected");
  const int64_t num_tokens = k.size(0), hkv = kv.size(2), bs = kv.size(3), d = kv.size(4);
  const int64_t num_blocks = kv.size(0), item = kv.element_size();
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = 2 * s_kv;
  at::Tensor blocks = slot_blocks.contiguous(), offsets = slot_offsets.contiguous();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  char* base = static_cast<char*>(kv.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(bp[t] >= 0 && bp[t] < num_blocks && op[t] >= 0 && op[t] < bs, "slot out of the pool");
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t dst = bp[t] * s_block + h * s_head + op[t] * d;
      std::memcpy(base + dst * item, kp + (t * k.stride(0) + h * k.stride(1)) * item, d * item);
      std::memcpy(base + (dst + s_kv) * item, vp + (t * v.stride(0) + h * v.stride(1)) * item, d * item);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv, Tensor block_table, Tensor query_start, Tensor context_lens, "
        "float scale, int window=0) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("store_kv(Tensor(a!) kv, Tensor k, Tensor v, Tensor slot_blocks, Tensor slot_offsets) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
