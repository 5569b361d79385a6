// Paged attention on CPU that reads K/V pages of the pool in place.
//
// Pool layer layout (HND inside a block): kv[N, P, Hkv, B, D], P planes: 2 (K then V), or 1 for
// DeepSeek's latent attention (MLA), whose one latent row per token is both the key and the value.
// For every sequence s, its query tokens q[query_start[s] .. query_start[s+1])
// sit at the last positions of its context (context_lens[s]); query j attends
// causally to keys 0 .. ctx - q_len + j, found through block_table[s]; with a sliding window W > 0
// (Mistral) only to the last W of them, its own included (Hugging Face: key > query - W).
// With sinks (gpt-oss: float [Hq]), query head h's softmax has one more term, exp(sinks[h]), in its
// denominator and none in the sum of values; both ops take them (`Tensor? sinks`, None: none).
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
// on x86-64 with GCC the 8-lane item function is built for AVX-512, AVX2 and baseline and picked at
// load time (target_clones), so one build is correct on any x86-64 CPU. On a CPU with AVX-512 the
// 16-lane kernels run instead, and for bfloat16 on one with AVX512-BF16 their scores come from
// vdpbf16ps (`kernels_now`); their value pass keeps 1-4 query heads' accumulators in registers over
// every page, and they ask for the pages ahead a row per key. On a 2-core Sapphire Rapids with the
// pool beyond the caches they read K/V at ~22 GB/s in bf16 and ~23 GB/s in float32, about what
// torch's `sum` reads there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_prefill.h"
#include "cpu_vec.h"

namespace {

// Lanes from `from` on (clamped to [0, L]) set to `fill`. A scalar loop rather than a lane-index
// compare: GCC 13.3 (Ubuntu 24.04's compiler) stops with an internal compiler error (do_store_flag)
// on `lane < n` in the AVX512-BF16 kernel, and the loop runs only for a chunk cut short.
template <int64_t L>
__attribute__((always_inline)) inline f32v<L> fill_from(f32v<L> v, int64_t from, float fill) {
  for (int64_t j = from < 0 ? 0 : from; j < L; ++j) v[j] = fill;
  return v;
}

// lane k of the result = the sum of the L lanes of v[k]. Each level adds the two halves of every
// partial sum, packing two inputs into one output; the order of the additions is the same for both
// lane counts (halves, then quarters, ...).
template <int64_t L>
__attribute__((always_inline)) inline f32v<L> sum_lanes_of_each(const f32v<L>* v) {
#if defined(__GNUC__) && !defined(__clang__)
  if constexpr (L == 8) {
    const i32v<8> lo1 = {0, 1, 2, 3, 8, 9, 10, 11};
    const i32v<8> hi1 = lo1 + 4;
    const i32v<8> lo2 = {0, 1, 4, 5, 8, 9, 12, 13};
    const i32v<8> hi2 = lo2 + 2;
    const i32v<8> lo3 = {0, 2, 4, 6, 8, 10, 12, 14};
    const i32v<8> hi3 = lo3 + 1;
    f32v<8> a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
    for (int i = 0; i < 2; ++i)
      b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
    return __builtin_shuffle(b[0], b[1], lo3) + __builtin_shuffle(b[0], b[1], hi3);
  } else {
    static_assert(L == 16, "8 or 16 lanes");
    const i32v<16> lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32v<16> hi1 = lo1 + 8;
    const i32v<16> lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i32v<16> hi2 = lo2 + 4;
    const i32v<16> lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i32v<16> hi3 = lo3 + 2;
    const i32v<16> lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i32v<16> hi4 = lo4 + 1;
    f32v<16> a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
    for (int i = 0; i < 4; ++i)
      b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
    for (int i = 0; i < 2; ++i)
      c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo3) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi3);
    return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
  }
#else
  f32v<L> out = {};
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
  int64_t planes;  // kv.size(1): 2 (K, V) or 1 (the V rows are the K rows)
  const float* sinks;  // [hq]: each query head's logit in its softmax denominator only (gpt-oss); null: none
};

// Per-thread buffers, sized once per parallel chunk (`scores` grows to the longest item's keys).
// Vectors are kept in plain float storage and moved with memcpy (unaligned loads): a std::vector of
// a vector type is not reliably aligned.
struct Scratch {
  std::vector<float> q, acc;  // [group][d rounded up to L]
  std::vector<float> scores;  // [group][stride]: the item's scores, then its softmax numerators
  std::vector<float> max;     // [group][L]: the largest score seen, per lane
  std::vector<float> inv;     // [group]: 1 / the sum of the numerators
  std::vector<float> rows;    // [block size][d]: a page's bfloat16 K or V rows widened once (`widen`)
  std::vector<uint16_t> qh;   // [group][d]: the bfloat16 query rows as they are (`dot`)
  Scratch(int64_t group, int64_t vecs, int64_t lanes, int64_t bs, int64_t d, bool widen, bool dot)
      : q(group * vecs * lanes),
        acc(group * vecs * lanes),
        max(group * lanes),
        inv(group),
        rows(widen ? bs * d + lanes : 0),
        qh(dot ? group * d : 0) {}
};

// Ask for the `bytes` at `p` (one head's rows of the next page: the pages of a sequence are anywhere
// in the pool, so the hardware prefetcher does not follow from one to the next).
// LOCALITY 3 asks for L1, 2 for L2 (prefetcht0 / prefetcht1).
template <int LOCALITY>
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, LOCALITY);
}

// Ask for row j (ROW_BYTES) of the page at `ahead` into L2, if there is one. The wide kernels ask
// for the page ahead a row per key they compute, where `prefetch` asked for it all at once: that
// burst held the core on the line-fill buffers, about a quarter of an in-cache bf16 item's cycles
// (perf, 2-core Sapphire Rapids), and spread over the work it hides behind it.
template <int64_t ROW_BYTES>
__attribute__((always_inline)) inline void ask_row(const char* ahead, int64_t j) {
  if (ahead)
#pragma GCC unroll 8
    for (int64_t b = 0; b < ROW_BYTES; b += 64) __builtin_prefetch(ahead + j * ROW_BYTES + b, 0, 2);
}

// the L lanes' scores of one chunk: lane j = q . k[j] for the chunk's n keys (FULL: n == L).
// The c loop is outside the j loop so that the L partial sums are L independent FMA chains: with j
// outside, each key's sum was one chain of d / L dependent FMAs, and the loop ran at FMA latency.
// With 16 lanes and a head size of VECS vectors the key loop is outside instead, every loop's count is
// known and unrolled, and the q vectors and partial sums live in registers: the loop above kept the 16
// partial vectors on the stack (zeroed with a memset, loaded and stored at every FMA). The additions
// are the same, in the same order. That path asks for row j of the page at `ahead` (ROW_BYTES a row;
// none if null) as it reads key j: the chunk is then a whole page of L keys.
template <int64_t L, typename T, bool FULL, int64_t VECS, int64_t ROW_BYTES>
__attribute__((always_inline)) inline f32v<L> chunk_scores(const float* qg, const T* krows, int64_t n, int64_t d,
                                                           int64_t vecs, int64_t tail, const char* ahead) {
  if constexpr (L == 16 && FULL && VECS > 0) {
    f32v<L> qv[VECS], partial[L];
#pragma GCC unroll 16
    for (int64_t c = 0; c < VECS; ++c) qv[c] = get<L>(qg + c * L);
#pragma GCC unroll 16
    for (int64_t j = 0; j < L; ++j) {
      ask_row<ROW_BYTES>(ahead, j);
      f32v<L> sum = qv[0] * load_row<L>(krows + j * d, L);
#pragma GCC unroll 16
      for (int64_t c = 1; c < VECS; ++c) sum += qv[c] * load_row<L>(krows + j * d + c * L, L);
      partial[j] = sum;
    }
    return sum_lanes_of_each<L>(partial);
  }
  f32v<L> partial[L] = {};
  for (int64_t c = 0; c < vecs; ++c) {
    const f32v<L> qv = get<L>(qg + c * L);
    const int64_t w = c == vecs - 1 ? tail : L;
    for (int64_t j = 0; j < (FULL ? L : n); ++j) partial[j] += qv * load_row<L>(krows + j * d + c * L, w);
  }
  return sum_lanes_of_each<L>(partial);
}

// The scores of one chunk from bfloat16 q and K rows with AVX512-BF16's vdpbf16ps: each instruction
// multiplies 32 pairs exactly and adds them into 16 float32 lanes, so no K row is widened (the widening
// was a third of a bf16 item's instructions). Lane j = q . k[j] for j < n, unscaled; 0 past n. d is a
// multiple of 32; only the dot kernels (`kernels_now`) run it (inline
// assembly: the instruction's intrinsics changed type between GCC 12 and 13). `ahead`: as chunk_scores.
template <int64_t VECS>
__attribute__((always_inline)) inline f32v<16> chunk_scores_dot(const uint16_t* qh, const at::BFloat16* krows,
                                                                int64_t n, int64_t d, const char* ahead) {
  typedef uint16_t u16x32 __attribute__((vector_size(64)));
  constexpr int64_t W = VECS / 2;  // 32 bfloat16 values a register
  u16x32 qv[W];
#pragma GCC unroll 16
  for (int64_t c = 0; c < W; ++c) std::memcpy(&qv[c], qh + c * 32, sizeof(u16x32));
  f32v<16> partial[16];
#pragma GCC unroll 16
  for (int64_t j = 0; j < 16; ++j) {
    ask_row<VECS * 32>(ahead, j);
    f32v<16> sum = {};
    if (j < n) {
#pragma GCC unroll 16
      for (int64_t c = 0; c < W; ++c) {
        u16x32 kv;
        std::memcpy(&kv, krows + j * d + c * 32, sizeof(kv));
        asm("vdpbf16ps %2, %1, %0" : "+v"(sum) : "v"(qv[c]), "v"(kv));
      }
    }
    partial[j] = sum;
  }
  return sum_lanes_of_each<16>(partial);
}

// acc[0 .. d) += sum over n keys of p[j] * v[j]. VECS > 0: d == VECS * L, and the accumulator is held
// in VECS registers (VECS independent FMA chains); 0: any d, in memory.
template <int64_t L, typename T, int64_t VECS>
__attribute__((always_inline)) inline void add_values(float* acc, const float* p, const T* vrows, int64_t n,
                                                      int64_t d, int64_t vecs, int64_t tail) {
  if constexpr (VECS > 0) {
    f32v<L> a[VECS];
    for (int64_t c = 0; c < VECS; ++c) a[c] = get<L>(acc + c * L);
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      for (int64_t c = 0; c < VECS; ++c) a[c] += pj * load_row<L>(vrows + j * d + c * L, L);
    }
    for (int64_t c = 0; c < VECS; ++c) put<L>(acc + c * L, a[c]);
  } else {
    for (int64_t c = 0; c < vecs; ++c) {
      const int64_t w = c == vecs - 1 ? tail : L;
      f32v<L> a = get<L>(acc + c * L);
      for (int64_t j = 0; j < n; ++j) a += p[j] * load_row<L>(vrows + j * d + c * L, w);
      put<L>(acc + c * L, a);
    }
  }
}

// The rows a pass reads, as the type it reads them in. With WIDEN (bfloat16, wide kernels) the n
// rows of d values are widened to float32 once into `buf`, and every query head of the group reads
// those: widening them per head cost two vector ops per value per head, as much as the FMAs.
template <int64_t L, bool WIDEN, typename T>
__attribute__((always_inline)) inline auto rows_for_heads(const T* rows, int64_t n, int64_t d, float* buf) {
  if constexpr (WIDEN) {
    const int64_t count = n * d;
    int64_t i = 0;
    for (; i + L <= count; i += L) put<L>(buf + i, load_row<L>(rows + i, L));
    if (i < count) put<L>(buf + i, load_row<L>(rows + i, count - i));  // buf has L floats of room
    return static_cast<const float*>(buf);
  } else {
    return rows;
  }
}

// One work item in three passes over its keys: every key's scores (K pages), the softmax numerators
// from the exact maximum (one vectorised exp loop), and the values weighted by them (V pages). An
// online softmax fused the three per chunk of keys, and its max -> exp -> sum -> rescale chain ran
// serially from one chunk to the next, at that chain's latency; apart, each pass's iterations are
// independent. The scores of an item are group x keys floats of per-thread scratch.
template <int64_t L, typename T, int64_t VECS, bool DOT>
__attribute__((always_inline)) inline void attend(const Problem& pb, int64_t item, Scratch& sc) {
  constexpr bool WIDEN = L == 16 && !std::is_same_v<T, float>;
  // DOT: bfloat16 scores by vdpbf16ps (16 lanes, a head size of an even number of vectors)
  static_assert(!DOT || (L == 16 && !std::is_same_v<T, float> && VECS > 0 && VECS % 2 == 0));
  // Pages are asked for AHEAD pages before their use. The wide kernels ask two ahead into L2: on a
  // 2-core Sapphire Rapids, one ahead into L1 left a bf16 call 10% slower (64 sequences x 300 keys,
  // pool beyond the caches); the narrow ones keep what was measured best on an AVX2 EPYC.
  constexpr int64_t AHEAD = L == 16 ? 2 : 1;
  constexpr int LOCALITY = L == 16 ? 2 : 3;
  // the wide kernels with a head size of whole vectors ask for pages a row at a time (`ask_row`)
  constexpr bool SPREAD = L == 16 && VECS > 0;
  constexpr int64_t ROW_BYTES = VECS * L * static_cast<int64_t>(sizeof(T));
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
  // strides of kv[N, P, Hkv, B, D] (contiguous); V rows start v_off after the K rows (0 with one plane)
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = pb.planes * s_kv, v_off = (pb.planes - 1) * s_kv;
  const int64_t page_bytes = s_head * static_cast<int64_t>(sizeof(T));
  if (static_cast<int64_t>(sc.scores.size()) < group * stride) sc.scores.resize(group * stride);
  float* scores = sc.scores.data();
  const auto head_rows = [&](int64_t key) { return kvp + pages[key / bs] * s_block + h * s_head + key % bs * d; };
  const auto page_k = [&](int64_t pi) { return kvp + pages[pi] * s_block + h * s_head; };
  const int64_t last_page = (end_key - 1) / bs;
  // Asks for page pi's rows of this head (K; V at kv_off = v_off) ahead of their use: all at once here,
  // or, `by_rows`, a row per key by the caller (`ask_row` on the returned pointer; else null).
  const auto ask_page = [&](int64_t pi, int64_t kv_off, bool by_rows) -> const char* {
    const T* rows = page_k(pi) + kv_off;
    if (by_rows) return reinterpret_cast<const char*>(rows);
    prefetch<LOCALITY>(rows, page_bytes);
    return nullptr;
  };

  for (int64_t g = 0; g < group; ++g) {
    const T* row = qp + t * pb.q_row + (h * group + g) * d;
    if constexpr (DOT)  // raw bf16 rows; the scale multiplies the scores
      std::memcpy(&sc.qh[g * d], row, d * sizeof(uint16_t));
    else
      for (int64_t c = 0; c < vecs; ++c)
        put<L>(&sc.q[(g * vecs + c) * L], load_row<L>(row + c * L, c == vecs - 1 ? tail : L) * pb.scale);
    if constexpr (!SPREAD) std::fill_n(&sc.acc[g * vecs * L], vecs * L, 0.0f);  // SPREAD's sweeps write it whole
    put<L>(&sc.max[g * L], f32v<L>{} - INFINITY);
  }
  // 1. scores, L keys at a time from one page; the lanes past the chunk's keys are -inf. The page
  // AHEAD on is asked for when a page is started, so that the work in between hides its latency.
  for (int64_t key = first; key < end_key;) {
    const int64_t off = key % bs;
    const int64_t n = std::min({end_key - key, bs - off, L});
    const auto krows = rows_for_heads<L, WIDEN && !DOT>(head_rows(key), n, d, sc.rows.data());
    using K = std::remove_cv_t<std::remove_pointer_t<decltype(krows)>>;
    const char* ahead = nullptr;  // a whole page's chunk (wide kernels) asks for the page AHEAD on a row a key
    if (off == 0 || key == first) {
      const int64_t pi = key / bs;
      if (key == first)
        for (int64_t a = 1; a < AHEAD; ++a)
          if (pi + a <= last_page) prefetch<LOCALITY>(page_k(pi + a), page_bytes);
      if (pi + AHEAD <= last_page) ahead = ask_page(pi + AHEAD, 0, SPREAD && n == L && bs == L);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = &sc.q[g * vecs * L];
      const char* ask = g == 0 ? ahead : nullptr;
      f32v<L> sv;
      if constexpr (DOT)
        sv = chunk_scores_dot<VECS>(&sc.qh[g * d], krows, n, d, ask) * pb.scale;
      else
        sv = n == L ? chunk_scores<L, K, true, VECS, ROW_BYTES>(qg, krows, n, d, vecs, tail, ask)
                    : chunk_scores<L, K, false, VECS, ROW_BYTES>(qg, krows, n, d, vecs, tail, nullptr);
      if (n < L) sv = fill_from<L>(sv, n, -INFINITY);
      put<L>(scores + g * stride + (key - first), sv);
      const f32v<L> mx = get<L>(&sc.max[g * L]);
      put<L>(&sc.max[g * L], sv > mx ? sv : mx);
    }
    key += n;
  }
  if constexpr (L == 16)  // pass 3's first pages, while pass 2 computes
    for (int64_t a = 0; a < AHEAD; ++a)
      if (first / bs + a <= last_page) prefetch<LOCALITY>(page_k(first / bs + a) + v_off, page_bytes);
  // 2. numerators exp(score - max) in place, and their sum. A chunk cut short by a page end wrote
  // -inf past its keys, which the next chunk overwrites, so the row is dense up to `keys`; past it
  // the lanes are masked to 0.
  for (int64_t g = 0; g < group; ++g) {
    const f32v<L> mv = get<L>(&sc.max[g * L]);
    float mx = mv[0];
    for (int64_t j = 1; j < L; ++j) mx = mv[j] > mx ? mv[j] : mx;
    // A sink joins the max as well as the sum: it can exceed every score, and exp(sink - max) must
    // not overflow. Once per (query, head), so the key loops stay as they are without sinks.
    const float sink = pb.sinks ? pb.sinks[h * group + g] : -INFINITY;
    mx = sink > mx ? sink : mx;
    float* row = scores + g * stride;
    // two vectors a step: their exps are independent chains the core can overlap
    f32v<L> total[2] = {};
    for (int64_t k = 0; k < padded; k += 2 * L) {
      for (int64_t u = 0; u < 2; ++u) {
        const int64_t left = keys - k - u * L;  // this vector's keys, if fewer than L
        f32v<L> p = exp_lanes<L>(get<L>(row + k + u * L) - mx);
        if (left < L) p = fill_from<L>(p, left, 0.0f);
        put<L>(row + k + u * L, p);
        total[u] += p;
      }
    }
    const f32v<L> both = total[0] + total[1];
    float sum = 0.0f;
    for (int64_t j = 0; j < L; ++j) sum += both[j];
    if (pb.sinks) sum += std::exp(sink - mx);  // the sink's share of the denominator; it has no value row
    sc.inv[g] = 1.0f / sum;
  }
  // 3. values. Wide kernels with a head size of whole vectors: one sweep over the V pages per CAP
  // query heads (as many as keep their accumulators and one V row in the 32 registers), each
  // accumulator in registers from the first key to the last, the bf16 rows widened in registers as
  // they are read. One head's accumulator alone is VECS chains that wait for the last FMA (4 cycles)
  // at every key; G heads give G x VECS independent chains. Spilling the accumulators at every page
  // and widening the page into scratch first cost ~10% and ~8% of a bf16 item (perf, 2-core
  // Sapphire Rapids). The first sweep asks for the pages ahead; later ones (GQA groups over CAP) find
  // them in L2. Every head's additions are the same, in the same order, as add_values's.
  if constexpr (SPREAD) {
    constexpr int64_t CAP = VECS <= 4 ? 4 : (VECS <= 8 ? 2 : 1);
    int64_t g = 0;
    const auto sweep = [&](auto count) {
      constexpr int64_t G = decltype(count)::value;
      f32v<L> a[G][VECS] = {};
      for (int64_t key = first; key < end_key;) {
        const int64_t off = key % bs, n = std::min(end_key - key, bs - off), pi = key / bs;
        const char* ahead = nullptr;
        if (g == 0 && (off == 0 || key == first) && pi + AHEAD <= last_page)
          ahead = ask_page(pi + AHEAD, v_off, n == bs);
        const T* vrows = head_rows(key) + v_off;
        const float* p = scores + g * stride + (key - first);
        for (int64_t j = 0; j < n; ++j) {
          ask_row<ROW_BYTES>(ahead, j);
          f32v<L> v[VECS];
          if constexpr (std::is_same_v<T, float>) {
#pragma GCC unroll 16
            for (int64_t c = 0; c < VECS; ++c) v[c] = load_row<L>(vrows + j * d + c * L, L);
          } else {
            // 32 bfloat16 values a load, as 16 pairs: the even ones are the low halves shifted up,
            // the odd ones the high halves masked; register 2m holds the even dims of values
            // 32m .. 32m + 31, register 2m + 1 the odd ones (put back in order below)
            static_assert(VECS % 2 == 0, "whole pairs of registers");
#pragma GCC unroll 8
            for (int64_t m = 0; m < VECS / 2; ++m) {
              typename Vec<L>::u32 w;
              std::memcpy(&w, vrows + j * d + m * 2 * L, sizeof(w));
              const typename Vec<L>::u32 even = w << 16, odd = w & 0xFFFF0000u;
              v[2 * m] = reinterpret_cast<const f32v<L>&>(even);
              v[2 * m + 1] = reinterpret_cast<const f32v<L>&>(odd);
            }
          }
#pragma GCC unroll 16
          for (int64_t h = 0; h < G; ++h) {
            const float pj = p[h * stride + j];
#pragma GCC unroll 16
            for (int64_t c = 0; c < VECS; ++c) a[h][c] += pj * v[c];
          }
        }
        key += n;
      }
      for (int64_t h = 0; h < G; ++h) {
        float* acc = &sc.acc[(g + h) * VECS * L];
        if constexpr (std::is_same_v<T, float>) {
#pragma GCC unroll 16
          for (int64_t c = 0; c < VECS; ++c) put<L>(acc + c * L, a[h][c]);
        } else {  // the dims back in order from the even / odd registers
          for (int64_t m = 0; m < VECS / 2; ++m)
            for (int64_t i = 0; i < L; ++i) {
              acc[m * 2 * L + 2 * i] = a[h][2 * m][i];
              acc[m * 2 * L + 2 * i + 1] = a[h][2 * m + 1][i];
            }
        }
      }
      g += G;
    };
    while (g < group) {
      if (group - g >= 4 && CAP >= 4)
        sweep(std::integral_constant<int64_t, 4>{});
      else if (group - g == 3 && CAP >= 3)
        sweep(std::integral_constant<int64_t, 3>{});
      else if (group - g >= 2 && CAP >= 2)
        sweep(std::integral_constant<int64_t, 2>{});
      else
        sweep(std::integral_constant<int64_t, 1>{});
    }
  } else {
    // a page's rows at a time (the page AHEAD on asked for first), each query head's accumulator in
    // registers across a page
    for (int64_t key = first; key < end_key;) {
      const int64_t off = key % bs;
      const int64_t n = std::min(end_key - key, bs - off);
      if (off == 0 || key == first) {
        const int64_t pi = key / bs;
        if (pi + AHEAD <= last_page) prefetch<LOCALITY>(page_k(pi + AHEAD) + v_off, page_bytes);
      }
      const auto vrows = rows_for_heads<L, WIDEN>(head_rows(key) + v_off, n, d, sc.rows.data());
      for (int64_t g = 0; g < group; ++g)
        add_values<L, std::remove_cv_t<std::remove_pointer_t<decltype(vrows)>>, VECS>(
            &sc.acc[g * vecs * L], scores + g * stride + (key - first), vrows, n, d, vecs, tail);
      key += n;
    }
  }
  T* op = static_cast<T*>(pb.out);
  for (int64_t g = 0; g < group; ++g) {
    const float* acc = &sc.acc[g * vecs * L];
    T* dst = op + (t * pb.hq + h * group + g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i] * sc.inv[g]);
  }
}

// Head sizes of 4, 8 and 16 vectors keep a query head's accumulator in registers (32, 64 and 128
// with 8 lanes; 64, 128 and 256 with 16); any other size takes the general path. Inlined into one
// function per element type and lane count (below).
template <int64_t L, typename T, bool DOT = false>
__attribute__((always_inline)) inline void attend_items(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  switch (pb.d) {
    case 4 * L:
      for (int64_t i = begin; i < end; ++i) attend<L, T, 4, DOT>(pb, i, sc);
      break;
    case 8 * L:
      for (int64_t i = begin; i < end; ++i) attend<L, T, 8, DOT>(pb, i, sc);
      break;
    case 16 * L:
      for (int64_t i = begin; i < end; ++i) attend<L, T, 16, DOT>(pb, i, sc);
      break;
    default:  // the dot product needs whole registers of 32 values
      for (int64_t i = begin; i < end; ++i) attend<L, T, 0, false>(pb, i, sc);
  }
}

PDS_CLONES void attend_items_f32(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  attend_items<8, float>(pb, begin, end, sc);
}
PDS_CLONES void attend_items_bf16(const Problem& pb, int64_t begin, int64_t end, Scratch& sc) {
  attend_items<8, at::BFloat16>(pb, begin, end, sc);
}

#ifdef PDS_X86_GCC
// The wide kernels: 16 lanes, one AVX-512 register, for CPUs that have AVX-512 (x86-64-v4). The 8-lane
// build's AVX-512 clone ran every vector op at half width; on a 2-core Sapphire Rapids decode
// attention took 47% of a bf16 run of engine_vs_vllm's workload and 23% of a float32 one.
#define PDS_WIDE 1
__attribute__((target("arch=x86-64-v4"))) void attend_items_f32_wide(const Problem& pb, int64_t begin, int64_t end,
                                                                      Scratch& sc) {
  attend_items<16, float>(pb, begin, end, sc);
}
__attribute__((target("arch=x86-64-v4"))) void attend_items_bf16_wide(const Problem& pb, int64_t begin, int64_t end,
                                                                       Scratch& sc) {
  attend_items<16, at::BFloat16>(pb, begin, end, sc);
}
// bfloat16 scores by vdpbf16ps, for CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later; Zen 4)
__attribute__((target("arch=x86-64-v4"))) void attend_items_bf16_dot(const Problem& pb, int64_t begin, int64_t end,
                                                                      Scratch& sc) {
  attend_items<16, at::BFloat16, true>(pb, begin, end, sc);
}
#endif

// Which kernels paged_attention runs now: narrow (8 lanes, any x86-64), wide (16 lanes, AVX-512) or
// dot (wide with bf16 scores by vdpbf16ps, AVX512-BF16; a float32 call runs wide). PDSERVE_CPU_NARROW=1
// and PDSERVE_CPU_NO_BF16_DOT=1 step down, for A/B runs and the tests that hold every variant to the
// reference; they are read at every call, so a test can switch them.
enum class Kernels : int64_t { narrow = 0, wide = 1, dot = 2 };
Kernels kernels_now() {
#ifdef PDS_WIDE
  const bool avx512 = pds::cpu_has_avx512();
  static const bool bf16_dot = avx512 && __builtin_cpu_supports("avx512bf16");
  if (!avx512 || std::getenv("PDSERVE_CPU_NARROW")) return Kernels::narrow;
  return bf16_dot && !std::getenv("PDSERVE_CPU_NO_BF16_DOT") ? Kernels::dot : Kernels::wide;
#else
  return Kernels::narrow;
#endif
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
         const at::Tensor& context_lens, double scale, int64_t window, const float* sinks, at::Tensor& out) {
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
                   table, qstart, ctx, seq_of.data(), hq, hkv, d, bs, max_pages, window, static_cast<float>(scale),
                   kv.size(1), sinks};
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
  const Kernels kernels = kernels_now();
  const bool wide = kernels != Kernels::narrow, dot = kernels == Kernels::dot, bf16 = !std::is_same_v<T, float>;
  const int64_t lanes = wide ? 16 : 8;
  at::parallel_for(0, ranges, 1, [&](int64_t first_range, int64_t end_range) {
    Scratch sc(hq / hkv, (d + lanes - 1) / lanes, lanes, bs, d, wide && bf16, dot && bf16);
    for (int64_t r = first_range; r < end_range; ++r) {
      const int64_t begin = bounds[r], end = bounds[r + 1];
#ifdef PDS_WIDE
      if (wide) {
        if constexpr (std::is_same_v<T, float>)
          attend_items_f32_wide(pb, begin, end, sc);
        else if (dot)
          attend_items_bf16_dot(pb, begin, end, sc);
        else
          attend_items_bf16_wide(pb, begin, end, sc);
        continue;
      }
#endif
      if constexpr (std::is_same_v<T, float>)
        attend_items_f32(pb, begin, end, sc);
      else
        attend_items_bf16(pb, begin, end, sc);
    }
  });
}

// Windows are compared with positions in 32-bit lanes; one this wide already covers any context, so a
// wider one (which would wrap) is the same attention.
constexpr int64_t kWidestWindow = std::numeric_limits<int32_t>::max();

// The checks both ops make; returns q as the kernels read it (a view with contiguous heads, such as a
// slice of the qkv projection, is read in place) and the index tensors contiguous.
std::array<at::Tensor, 4> checked(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& query_start, const at::Tensor& context_lens, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "cpu_paged attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && (kv.size(1) == 1 || kv.size(1) == 2),
              "q [T,Hq,D], kv [N,P,Hkv,B,D] with P = 2 (K, V) or 1 (MLA latent) expected");
  TORCH_CHECK(kv.size(3) > 0, "kv pages must hold at least one token (block size B > 0)");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(kv.size(2) > 0 && q.size(2) == kv.size(4) && q.size(1) % kv.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt, "index tensors must be int32");
  TORCH_CHECK(kv.is_contiguous(), "kv layer must be contiguous");
  TORCH_CHECK(window >= 0, "sliding window must be >= 0 (0: none)");
  TORCH_CHECK(block_table.dim() == 2 && context_lens.dim() == 1 && block_table.size(0) == context_lens.size(0) &&
                  query_start.numel() == context_lens.size(0) + 1,
              "block_table [S, P] and query_start [S + 1] must match context_lens [S]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "cpu_paged attention supports float32 and bfloat16, got ", q.scalar_type());
  at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  at::Tensor bt = block_table.contiguous(), qs = query_start.contiguous(), cl = context_lens.contiguous();
  check_pages(bt, qs, cl, q.size(0), kv.size(0), kv.size(3));
  return {qc, bt, qs, cl};
}

// The sinks as the kernels read them: float32 [Hq] (a model's bf16 copy is widened here, Hq values), or
// an undefined tensor for none (None, or an empty tensor: callers with no sinks may pass either).
at::Tensor checked_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q) {
  if (!sinks.has_value() || !sinks->defined() || sinks->numel() == 0) return at::Tensor();
  TORCH_CHECK(sinks->device().is_cpu() && sinks->dim() == 1 && sinks->size(0) == q.size(1),
              "sinks must be a CPU tensor [Hq] of one logit per query head, got ", sinks->sizes());
  TORCH_CHECK(at::isFloatingType(sinks->scalar_type()), "sinks must be floating point");
  return sinks->to(at::kFloat).contiguous();
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                           const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                           int64_t window, const std::optional<at::Tensor>& sinks) {
  auto [qc, bt, qs, cl] = checked(q, kv, block_table, query_start, context_lens, window);
  window = std::min<int64_t>(window, kWidestWindow);
  const at::Tensor sk = checked_sinks(sinks, q);
  const float* sp = sk.defined() ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat)
    run<float>(qc, kv, bt, qs, cl, scale, window, sp, out);
  else
    run<at::BFloat16>(qc, kv, bt, qs, cl, scale, window, sp, out);
  return out;
}

// The same attention for sequences with many query tokens (prompts, long chunks), by the kernel of
// cpu_prefill_attention.cpp; only where `prefill_supported` says it runs. bf16 runs on AMX tiles
// (cpu_amx_prefill.cpp) where `prefill_amx_supported` says so, unless `amx` is false.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                   const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                                   int64_t window, bool amx, const std::optional<at::Tensor>& sinks) {
  auto [qc, bt, qs, cl] = checked(q, kv, block_table, query_start, context_lens, window);
  window = std::min<int64_t>(window, kWidestWindow);
  const at::Tensor sk = checked_sinks(sinks, q);
  TORCH_CHECK(pds::prefill_supported(q.size(2)), "the prompt kernel needs AVX-512 and a head size that is a ",
              "multiple of 16 up to 256; see prefill_supported");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const pds::PrefillProblem pb{qc.data_ptr(), qc.stride(0), kv.data_ptr(), out.data_ptr(),
                               bt.data_ptr<int32_t>(), qs.data_ptr<int32_t>(), cl.data_ptr<int32_t>(),
                               cl.size(0), q.size(1), kv.size(2), q.size(2), kv.size(3), bt.size(1), window,
                               static_cast<float>(scale), kv.size(1), sk.defined() ? sk.data_ptr<float>() : nullptr};
  if (q.scalar_type() == at::kFloat)
    pds::prefill_attention_f32(pb);
  else if (amx && pds::amx_prefill_supported(q.size(2)))
    pds::prefill_attention_amx(pb);
  else
    pds::prefill_attention_bf16(pb);
  return out;
}

// kv[slot_blocks[t], 0/1, :, slot_offsets[t]] = k[t] / v[t] for every new token t. One serial
// pass of row copies: torch's advanced-index assignment costs two parallel index_put_ per layer.
// A one-plane pool (MLA) stores k only: its latent is the key and the value (v, the same tensor
// from the model, is not read).
void store_kv(at::Tensor kv, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_blocks,
              const at::Tensor& slot_offsets) {
  TORCH_CHECK(kv.dim() == 5 && (kv.size(1) == 1 || kv.size(1) == 2) && kv.is_contiguous(),
              "kv [N,P,Hkv,B,D] contiguous with P = 2 (K, V) or 1 (MLA latent) expected");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv.size(2) && k.size(2) == kv.size(4),
              "k/v [T,Hkv,D] matching the pool expected");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(), "k/v dtype differs");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v rows must be contiguous");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0), "int64 slots [T] expected");
  const int64_t num_tokens = k.size(0), hkv = kv.size(2), bs = kv.size(3), d = kv.size(4);
  const int64_t num_blocks = kv.size(0), item = kv.element_size();
  const bool has_v = kv.size(1) == 2;
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = kv.size(1) * s_kv;
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
      if (has_v) std::memcpy(base + (dst + s_kv) * item, vp + (t * v.stride(0) + h * v.stride(1)) * item, d * item);
    }
  }
}

}  // namespace

// `kernels_now` for Python: 0 the 8-lane kernels, 1 the 16-lane ones, 2 those with bf16 scores by
// vdpbf16ps (for a bfloat16 call; float32 calls run the 16-lane ones).
int64_t attention_kernels() { return static_cast<int64_t>(kernels_now()); }
bool prefill_supported_op(int64_t head_dim) { return pds::prefill_supported(head_dim); }
bool prefill_amx_supported_op(int64_t head_dim) { return pds::amx_prefill_supported(head_dim); }

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("attention_kernels() -> int", &attention_kernels);
  m.def("paged_attention(Tensor q, Tensor kv, Tensor block_table, Tensor query_start, Tensor context_lens, "
        "float scale, int window=0, Tensor? sinks=None) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("prefill_supported(int head_dim) -> bool", &prefill_supported_op);
  m.def("prefill_amx_supported(int head_dim) -> bool", &prefill_amx_supported_op);
  m.def("paged_prefill_attention(Tensor q, Tensor kv, Tensor block_table, Tensor query_start, "
        "Tensor context_lens, float scale, int window=0, bool amx=True, Tensor? sinks=None) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.def("store_kv(Tensor(a!) kv, Tensor k, Tensor v, Tensor slot_blocks, Tensor slot_offsets) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
