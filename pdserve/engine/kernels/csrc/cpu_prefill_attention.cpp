// Attention for prompts on CPU: many query tokens of a sequence at once, over its K/V pages in place.
//
// The decode kernel (cpu_paged_attention.cpp) takes one query token at a time, which is right when
// there is one; a prompt has hundreds, and SDPA's flash kernel, which ran them before, reached
// 64 GFLOP/s in float32 on a 512-token prompt (2-core Sapphire Rapids), a fifth of the FMA peak.
//
// Here the query rows are the vector lanes. A work item is 64 query rows, (token, head) pairs of one
// kv head's group, transposed once into 4 vectors of 16 rows per head dimension. Each K value of a
// chunk of 16 keys is broadcast against a row vector, so the 16 keys' scores come out of 16
// independent FMA chains with no horizontal sums; the online softmax's max, exp and sum are lane-wise,
// one lane per row; and the output stays transposed ([D][rows]), rescaled lane-wise and multiplied in
// with each V value broadcast. Only at the end is it transposed back and divided by the sums.
//
// Masks: query j (position p) sees keys 0..p, and with a sliding window W only those above p - W.
// Chunks wholly inside every row's range skip the mask. Sinks (gpt-oss) join each row's sum once, at
// the end. Float32 throughout (bf16 K/V widened a chunk at a time, a float32 exp: `exp_f32`); bf16
// output rounded once at the end.
//
// AVX-512 only (the 16-lane variant, target x86-64-v4, built with GCC on x86-64); other CPUs and
// builds keep SDPA (`prefill_supported`).
#include "cpu_prefill.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_vec.h"

#ifdef PDS_X86_GCC
namespace {

constexpr int64_t L = 16;   // lanes: query rows per vector
constexpr int64_t RV = 4;   // row vectors per work item (64 query rows)
constexpr int64_t KC = 16;  // keys per chunk
constexpr int64_t MAX_D = 256;
typedef f32v<L> v16;
typedef i32v<L> i16v;

// Per-thread buffers, sized once per parallel range.
struct Scratch {
  std::vector<float> qt, ot;  // [d][RV][L]: the item's queries and (unnormalised) outputs, transposed
  std::vector<float> m, l;    // [RV][L]: running max and sum of each row
  std::vector<int32_t> pos;   // [RV][L]: each row's position in its sequence; -1 for padding rows
  std::vector<float> p;       // [KC][L]: one row vector's probabilities over a chunk
  std::vector<float> kf, vf;  // [KC][d]: a chunk's K and V rows in float32, zero past its keys
  std::vector<float> sink;    // [RV][L]: each row's head's sink logit (with sinks only)
  explicit Scratch(int64_t d)
      : qt(d * RV * L),
        ot(d * RV * L),
        m(RV * L),
        l(RV * L),
        pos(RV * L),
        p(KC * L),
        kf(KC * d),
        vf(KC * d),
        sink(RV * L) {}
};

// exp of every lane in float32: pds::fast_exp's Cephes polynomial (~1 ulp), 16 lanes at a time. The
// float64 exp_lanes of the decode kernel (glibc's rounding, for exact greedy parity there) was a
// sixth of this kernel's cycles; SDPA's flash kernel, which this replaces, used a float32 exp too.
// Below the clamp the result is 0, not exp(clamp) ~ 1e-38: the masked keys' -inf scores would make
// that a subnormal in every product with V, which ran the kernel 10x slower.
__attribute__((always_inline)) inline v16 exp_f32(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447505531f;
  const auto underflow = x < lo;
  x = x > hi ? hi : x;
  x = underflow ? lo : x;
  v16 n;
  const v16 p = pds::exp_mantissa(x, n);
  const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
  return underflow ? v16{} : p * reinterpret_cast<const v16&>(e);
}

inline float to_f32(float x) { return x; }
inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }
inline void from_f32(float* dst, float x) { *dst = x; }
inline void from_f32(at::BFloat16* dst, float x) {
  const uint16_t bits = pds::f2b(x);
  std::memcpy(dst, &bits, sizeof(bits));
}

// `n` rows of `d` values from `src` (a page's K or V rows) into `dst` as float32, rows n..KC zeroed
template <typename T>
__attribute__((always_inline)) inline void widen_rows(float* dst, const T* src, int64_t n, int64_t d) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; c += L) put<L>(dst + j * d + c, load_row<L>(src + j * d + c, L));
  std::memset(dst + n * d, 0, (KC - n) * d * sizeof(float));
}

// D: the head size when known at compile time (0: pb.d), so that the 16 keys' broadcast K values are
// constant offsets from one register; with a run-time head size GCC kept the 16 row addresses on the stack.
template <typename T, int64_t D>
__attribute__((always_inline)) inline void attend_rows(const pds::PrefillProblem& pb, const pds::RowSpan& it, Scratch& sc) {
  const int64_t d = D > 0 ? D : pb.d, g = pb.hq / pb.hkv, s = it.seq, h = it.head;
  const int64_t q_len = pb.qstart[s + 1] - pb.qstart[s], first_pos = pb.ctx[s] - q_len;
  const int64_t rows = it.row_end - it.row0;
  const T* q = static_cast<const T*>(pb.q);
  // the item's rows, transposed: qt[c][row]
  for (int64_t r = 0; r < RV * L; ++r) {
    const int64_t row = it.row0 + r, t = row / g;
    sc.pos[r] = r < rows ? static_cast<int32_t>(first_pos + t) : -1;
    if (pb.sinks) sc.sink[r] = r < rows ? pb.sinks[h * g + row % g] : 0.0f;
    const T* src = q + (pb.qstart[s] + t) * pb.q_row + (h * g + row % g) * d;
    for (int64_t c = 0; c < d; ++c) sc.qt[(c * RV + r / L) * L + r % L] = r < rows ? to_f32(src[c]) : 0.0f;
  }
  std::fill(sc.ot.begin(), sc.ot.end(), 0.0f);
  std::fill(sc.m.begin(), sc.m.end(), -1e30f);  // finite: a row with no key yet gets alpha = 1, not NaN
  std::fill(sc.l.begin(), sc.l.end(), 0.0f);
  const int64_t min_pos = sc.pos[0], max_pos = it.max_pos, lo = it.lo, hi = max_pos;
  const int64_t vecs = (rows + L - 1) / L;
  const int64_t head_stride = pb.bs * d, kv_stride = pb.hkv * head_stride;
  const T* kv = static_cast<const T*>(pb.kv);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t page = lo / pb.bs; page <= hi / pb.bs; ++page) {
    const int64_t block = pb.table[s * pb.max_pages + page];
    const T* kpage = kv + block * pb.planes * kv_stride + h * head_stride;
    const T* vpage = kpage + (pb.planes - 1) * kv_stride;  // one plane: the values are the keys
    for (int64_t off = 0; off < pb.bs; off += KC) {
      const int64_t k0 = page * pb.bs + off, n = std::min({KC, pb.bs - off, hi + 1 - k0});
      if (n <= 0) break;
      if (k0 + n <= lo) continue;
      const float *kr, *vr;
      if (std::is_same_v<T, float> && n == KC) {  // whole float32 chunks are read in place
        kr = reinterpret_cast<const float*>(kpage + off * d);
        vr = reinterpret_cast<const float*>(vpage + off * d);
      } else {
        widen_rows(sc.kf.data(), kpage + off * d, n, d);
        widen_rows(sc.vf.data(), vpage + off * d, n, d);
        kr = sc.kf.data();
        vr = sc.vf.data();
      }
      const bool full = n == KC && k0 + KC - 1 <= min_pos && (pb.window <= 0 || k0 > max_pos - pb.window);
      for (int64_t rv = 0; rv < vecs; ++rv) {
        v16 sv[KC] = {};
        for (int64_t c = 0; c < d; ++c) {
          const v16 qv = get<L>(sc.qt.data() + (c * RV + rv) * L);
#pragma GCC unroll 16
          for (int64_t j = 0; j < KC; ++j) sv[j] += kr[j * d + c] * qv;
        }
        v16 cmax = v16{} + neg_inf;
        i16v posv;
        std::memcpy(&posv, sc.pos.data() + rv * L, sizeof(posv));
#pragma GCC unroll 16
        for (int64_t j = 0; j < KC; ++j) {
          sv[j] *= pb.scale;
          if (!full) {
            const i16v key = i16v{} + static_cast<int32_t>(k0 + j);
            i16v ok = key <= posv;
            if (pb.window > 0) ok &= key > posv - static_cast<int32_t>(pb.window);
            if (j >= n) ok = i16v{};
            sv[j] = ok ? sv[j] : v16{} + neg_inf;
          }
          cmax = cmax > sv[j] ? cmax : sv[j];
        }
        const v16 m_old = get<L>(sc.m.data() + rv * L);
        const v16 m_new = m_old > cmax ? m_old : cmax;
        const v16 alpha = exp_f32(m_old - m_new);
        v16 sum = {};
#pragma GCC unroll 16
        for (int64_t j = 0; j < KC; ++j) {
          const v16 pj = exp_f32(sv[j] - m_new);
          sum += pj;
          put<L>(sc.p.data() + j * L, pj);
        }
        put<L>(sc.m.data() + rv * L, m_new);
        put<L>(sc.l.data() + rv * L, get<L>(sc.l.data() + rv * L) * alpha + sum);
        for (int64_t cb = 0; cb < d; cb += 16) {
          v16 acc[16];
#pragma GCC unroll 16
          for (int64_t cc = 0; cc < 16; ++cc) acc[cc] = get<L>(sc.ot.data() + ((cb + cc) * RV + rv) * L) * alpha;
          for (int64_t j = 0; j < KC; ++j) {
            const v16 pj = get<L>(sc.p.data() + j * L);
#pragma GCC unroll 16
            for (int64_t cc = 0; cc < 16; ++cc) acc[cc] += vr[j * d + cb + cc] * pj;
          }
#pragma GCC unroll 16
          for (int64_t cc = 0; cc < 16; ++cc) put<L>(sc.ot.data() + ((cb + cc) * RV + rv) * L, acc[cc]);
        }
      }
    }
  }
  // normalise lane-wise (a scalar division per value cost a quarter of the item), then transpose back
  for (int64_t rv = 0; rv < vecs; ++rv) {
    const v16 sum = get<L>(sc.l.data() + rv * L);
    if (pb.sinks) {
      // The sink is one more term of each row's denominator, with no value: taken once at the end, as
      // a last key would be, so that the max moves to it where it is larger (it may exceed every
      // score) and nothing overflows; then o * alpha / (l * alpha + exp(sink - max)).
      const v16 m = get<L>(sc.m.data() + rv * L), sink = get<L>(sc.sink.data() + rv * L);
      const v16 m_new = m > sink ? m : sink;
      const v16 alpha = exp_f32(m - m_new);
      const v16 factor = alpha / (sum * alpha + exp_f32(sink - m_new));
      for (int64_t c = 0; c < d; ++c) {
        float* o = sc.ot.data() + (c * RV + rv) * L;
        put<L>(o, get<L>(o) * factor);
      }
      continue;
    }
    for (int64_t c = 0; c < d; ++c) {
      float* o = sc.ot.data() + (c * RV + rv) * L;
      put<L>(o, get<L>(o) / sum);
    }
  }
  T* out = static_cast<T*>(pb.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = it.row0 + r, t = row / g;
    T* dst = out + ((pb.qstart[s] + t) * pb.hq + h * g + row % g) * d;
    for (int64_t c = 0; c < d; ++c) from_f32(dst + c, sc.ot[(c * RV + r / L) * L + r % L]);
  }
}

template <typename T>
__attribute__((target("arch=x86-64-v4"))) void attend_range(const pds::PrefillProblem& pb, const pds::RowSpan* items,
                                                             int64_t n, Scratch& sc) {
  switch (pb.d) {
    case 64:
      for (int64_t i = 0; i < n; ++i) attend_rows<T, 64>(pb, items[i], sc);
      break;
    case 128:
      for (int64_t i = 0; i < n; ++i) attend_rows<T, 128>(pb, items[i], sc);
      break;
    default:
      for (int64_t i = 0; i < n; ++i) attend_rows<T, 0>(pb, items[i], sc);
  }
}

template <typename T>
void run(const pds::PrefillProblem& pb) {
  // items of 64 rows; their cost (rows x keys) splits them into one contiguous range per thread
  std::vector<int64_t> cost_before;
  const std::vector<pds::RowSpan> items = pds::row_spans(pb, [](int64_t) { return RV * L; }, cost_before);
  const std::vector<int64_t> bounds = pds::cost_bounds(cost_before, at::get_num_threads());
  const int64_t ranges = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    Scratch sc(pb.d);
    for (int64_t r = first; r < last; ++r) attend_range<T>(pb, items.data() + bounds[r], bounds[r + 1] - bounds[r], sc);
  });
}

}  // namespace

namespace pds {

bool prefill_supported(int64_t d) { return cpu_has_avx512() && d % 16 == 0 && d > 0 && d <= MAX_D; }
void prefill_attention_f32(const PrefillProblem& pb) { run<float>(pb); }
void prefill_attention_bf16(const PrefillProblem& pb) { run<at::BFloat16>(pb); }

}  // namespace pds
#else
namespace pds {

bool prefill_supported(int64_t) { return false; }
void prefill_attention_f32(const PrefillProblem&) { TORCH_CHECK(false, "no prompt kernel in this build"); }
void prefill_attention_bf16(const PrefillProblem&) { TORCH_CHECK(false, "no prompt kernel in this build"); }

}  // namespace pds
#endif
