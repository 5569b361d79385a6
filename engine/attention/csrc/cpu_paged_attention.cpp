// Paged attention on CPU that reads K/V pages of the pool in place.
//
// Pool layer layout (HND inside a block): kv[N, 2, Hkv, B, D].
// For every sequence s, its query tokens q[query_start[s] .. query_start[s+1])
// sit at the last positions of its context (context_lens[s]); query j attends
// causally to keys 0 .. ctx - q_len + j, found through block_table[s]; with a sliding window W > 0
// (Mistral) only to the last W of them, its own included (Hugging Face: key > query - W).
//
// One work item is (query token, kv head): the group's Hq/Hkv query heads share each K/V row
// read. Keys are taken 8 at a time from one page (blocked): the 8 keys' dot products are 8
// independent FMA chains over the head dimension, summed into one vector of 8 scores by a shuffle
// tree; softmax is online (running max and sum per query head, float32) with a vectorised exp; and
// for head sizes 32, 64 and 128 a query head's output accumulator stays in registers while the
// chunk's value rows are added into it (one independent FMA chain per 8-wide slice). The K/V rows
// two chunks ahead are prefetched, since the next page can be anywhere in the pool.
// Measured on an AVX2 EPYC (2 threads, bench-model heads, 64 sequences x 300 keys, perf): the
// previous version of this loop (one dependent FMA chain per key and per slice, a scalar exp per
// key) waited on FMA latency for two thirds of its cycles; this one is near the DRAM bandwidth,
// and a decode step's attention went from ~71 to ~40 ms (BENCHMARKS.md).
//
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
constexpr int64_t PREFETCH_KEYS = 2 * L;  // how far ahead K/V rows are prefetched (chunks of L keys)
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

// Per-thread buffers, sized once per parallel chunk. Vectors are kept in plain float storage and
// moved with memcpy (unaligned loads): a std::vector of a vector type is not reliably aligned.
struct Scratch {
  std::vector<float> q, acc;  // [group][d rounded up to L]
  std::vector<float> prob;    // [group][L]: this chunk's softmax numerators
  std::vector<float> max, sum, corr;
  Scratch(int64_t group, int64_t vecs)
      : q(group * vecs * L), acc(group * vecs * L), prob(group * L), max(group), sum(group), corr(group) {}
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
  // Taylor to r^10: relative error below 3e-13 on |r| <= 0.347
  f64x4 p = f64x4{} + 1.0 / 3628800;
  for (const double c : {1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0})
    p = p * r + c;
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

// acc[0 .. d) = acc * corr + sum over the chunk's n keys of p[j] * v[j]. VECS > 0: d == VECS * L, and
// the accumulator is held in VECS registers (VECS independent FMA chains); 0: any d, in memory.
template <typename T, int64_t VECS>
__attribute__((always_inline)) inline void add_values(float* acc, const float* p, float corr, const T* vrows,
                                                      int64_t n, int64_t d, int64_t vecs, int64_t tail) {
  if constexpr (VECS > 0) {
    f32xL a[VECS];
    for (int64_t c = 0; c < VECS; ++c) a[c] = get(acc + c * L) * corr;
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      for (int64_t c = 0; c < VECS; ++c) a[c] += pj * load_row(vrows + j * d + c * L, L);
    }
    for (int64_t c = 0; c < VECS; ++c) put(acc + c * L, a[c]);
  } else {
    for (int64_t c = 0; c < vecs; ++c) {
      const int64_t w = c == vecs - 1 ? tail : L;
      f32xL a = get(acc + c * L) * corr;
      for (int64_t j = 0; j < n; ++j) a += p[j] * load_row(vrows + j * d + c * L, w);
      put(acc + c * L, a);
    }
  }
}

template <typename T, int64_t VECS>
__attribute__((always_inline)) inline void attend(const Problem& pb, int64_t item, Scratch& sc) {
  const int64_t hkv = pb.hkv, d = pb.d, bs = pb.bs, group = pb.hq / hkv;
  const int64_t vecs = VECS > 0 ? VECS : (d + L - 1) / L, tail = d - (vecs - 1) * L;
  const int64_t t = item / hkv, h = item % hkv, s = pb.seq_of[t];
  const int64_t q_len = pb.qstart[s + 1] - pb.qstart[s];
  const int64_t end_key = pb.ctx[s] - q_len + (t - pb.qstart[s]) + 1;  // causal: keys 0 .. own position
  const int64_t first = pb.window > 0 ? std::max<int64_t>(0, end_key - pb.window) : 0;
  const int32_t* pages = pb.table + s * pb.max_pages;
  const T* qp = static_cast<const T*>(pb.q);
  const T* kvp = static_cast<const T*>(pb.kv);
  // strides of kv[N, 2, Hkv, B, D] (contiguous)
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = 2 * s_kv;
  const i32xL lane = {0, 1, 2, 3, 4, 5, 6, 7};

  for (int64_t g = 0; g < group; ++g) {
    const T* row = qp + t * pb.q_row + (h * group + g) * d;
    for (int64_t c = 0; c < vecs; ++c)
      put(&sc.q[(g * vecs + c) * L], load_row(row + c * L, c == vecs - 1 ? tail : L) * pb.scale);
    std::fill_n(&sc.acc[g * vecs * L], vecs * L, 0.0f);
    sc.max[g] = -INFINITY;
    sc.sum[g] = 0.0f;
  }
  for (int64_t key = first; key < end_key;) {
    const int64_t off = key % bs;
    const int64_t n = std::min({end_key - key, bs - off, L});  // keys of this chunk, all in one page
    const T* krows = kvp + pages[key / bs] * s_block + h * s_head + off * d;
    const T* vrows = krows + s_kv;
    // Ask for the K and V rows PREFETCH_KEYS ahead now: a head's rows of one page are only
    // bs * d values, and the next page is anywhere in the pool, so the hardware prefetcher rarely
    // has them in time.
    if (const int64_t ahead = key + PREFETCH_KEYS; ahead < end_key) {
      const char* kn = reinterpret_cast<const char*>(kvp + pages[ahead / bs] * s_block + h * s_head + (ahead % bs) * d);
      const int64_t bytes = std::min<int64_t>(end_key - ahead, L) * d * static_cast<int64_t>(sizeof(T));
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(kn + b, 0, 3);
        __builtin_prefetch(kn + s_kv * static_cast<int64_t>(sizeof(T)) + b, 0, 3);
      }
    }
    const i32xL live = lane < static_cast<int32_t>(n);  // lanes that hold one of the chunk's keys
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = &sc.q[g * vecs * L];
      f32xL scores = n == L ? chunk_scores<T, true>(qg, krows, n, d, vecs, tail)
                            : chunk_scores<T, false>(qg, krows, n, d, vecs, tail);
      scores = live ? scores : f32xL{} - INFINITY;
      float mx = sc.max[g];
      for (int64_t j = 0; j < L; ++j) mx = scores[j] > mx ? scores[j] : mx;
      const f32xL prob = live ? exp_lanes(scores - mx) : f32xL{};
      put(&sc.prob[g * L], prob);
      float total = 0.0f;
      for (int64_t j = 0; j < L; ++j) total += prob[j];
      // rescales what earlier chunks summed (0 on the first; 1, without an exp, while the max holds)
      sc.corr[g] = mx == sc.max[g] ? 1.0f : std::exp(sc.max[g] - mx);
      sc.sum[g] = sc.sum[g] * sc.corr[g] + total;
      sc.max[g] = mx;
    }
    for (int64_t g = 0; g < group; ++g)
      add_values<T, VECS>(&sc.acc[g * vecs * L], &sc.prob[g * L], sc.corr[g], vrows, n, d, vecs, tail);
    key += n;
  }
  T* op = static_cast<T*>(pb.out);
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / sc.sum[g];
    const float* acc = &sc.acc[g * vecs * L];
    T* dst = op + (t * pb.hq + h * group + g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i] * inv);
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

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& query_start,
         const at::Tensor& context_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_tokens = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(2), bs = kv.size(3);
  const int64_t num_seqs = context_lens.size(0);
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  // token -> sequence, so work items can be flat over (token, kv head)
  std::vector<int32_t> seq_of(num_tokens);
  int64_t total_keys = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int32_t t = qstart[s]; t < qstart[s + 1]; ++t) {
      seq_of[t] = static_cast<int32_t>(s);
      const int64_t keys = ctx[s] - (qstart[s + 1] - t) + 1;
      total_keys += window > 0 ? std::min<int64_t>(keys, window) : keys;
    }
  const Problem pb{q.data_ptr<T>(), q.stride(0), kv.data_ptr<T>(), out.data_ptr<T>(),
                   block_table.data_ptr<int32_t>(), qstart, ctx, seq_of.data(),
                   hq, hkv, d, bs, block_table.size(1), window, static_cast<float>(scale)};
  // Work items per thread chunk: about 256K K/V values read. A batch-1 decode step reads far fewer,
  // and waking the other OpenMP threads can cost a scheduler time slice on a loaded machine.
  const int64_t values_per_item = std::max<int64_t>(1, 2 * d * total_keys / std::max<int64_t>(num_tokens, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / values_per_item);
  at::parallel_for(0, num_tokens * hkv, grain, [&](int64_t begin, int64_t end) {
    Scratch sc(hq / hkv, (d + L - 1) / L);
    if constexpr (std::is_same_v<T, float>)
      attend_items_f32(pb, begin, end, sc);
    else
      attend_items_bf16(pb, begin, end, sc);
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
  // a view with contiguous heads (a slice of the qkv projection) is read in place
  at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  at::Tensor bt = block_table.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(qc, kv, bt, query_start.contiguous(), context_lens.contiguous(), scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(qc, kv, bt, query_start.contiguous(), context_lens.contiguous(), scale, window, out);
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
