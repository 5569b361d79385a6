// A float32 linear on AVX-512 for decode steps and short prompt chunks:
// y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 throughout.
//
// Why: at decode sizes oneDNN's float32 GEMM pays for its weight reads and its multiplies one
// after the other. On 2 cores of the AMX Xeon guest (bench-model shapes, weights out of cache) a
// step's linears took 22 ms at 16 rows, where the weights' memory time alone is ~15 ms, and 43 ms
// at 64 rows, where memory (15 ms) and the multiplies at oneDNN's large-GEMM rate (~29 ms) add up
// to it. This kernel keeps a chunk of each weight panel in L1 for every row of the batch and asks
// for the next panel while it computes, at an even rate (the same requests in one burst per tile
// gained 0-9%), so the two overlap: 1.2-1.3x oneDNN at 1-64 rows, 1.1x at 96, 1.05x at 128
// (`python -m benchmarks.amx_linear --dtype float32`). From ~192 rows on, where the multiplies
// dominate, oneDNN's blocking for many rows wins, so the caller (pdserve/engine/layers.py `Linear`) sends
// only up to `F32_MAX_ROWS` rows here.
//
// The weight is the one oneDNN already holds, prepacked by `torch.ops.mkldnn._reorder_linear_weight`:
// on an AVX-512 CPU its float32 layout is [N/64][K][64] (64-column panels, each K rows of 64
// contiguous values). No second copy of the weights exists; `Linear` checks that layout bit for
// bit against the checkpoint's weight before it sends anything here, and this op checks sizes.
//
// Numerics: each output is one float32 FMA chain over k in order, then + bias: the same products
// as oneDNN's, summed in another order (a few float32 ulps apart).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_packed.h"

#ifdef PDS_X86_GCC
#define PDS_F32_LINEAR 1
#include <immintrin.h>
#define PDS_F32_TARGET __attribute__((target("avx512f")))
#endif

namespace {

constexpr int64_t kCols = 64;       // output columns of one packed panel: 4 registers of 16
constexpr int64_t kTileRows = 6;    // rows of x per register tile: 6 x 4 accumulators
constexpr int64_t kChunk = 128;     // K values per chunk: 128 x 256 B = 32 KB of the panel, in L1
constexpr int64_t kSliceRows = 128;  // rows per pass over the weights (x's slice stays in L2)

struct Problem {
  const float* x;  // [M, lda], K used
  int64_t lda;
  const float* w;     // packed [N/64][K][64]
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t M, N, K;
};

#ifdef PDS_F32_LINEAR
// The next panel's cache lines, asked for at an even rate over the k steps of this one: `lines`
// lines every `steps` k steps (a burst of requests at once would fill the core's miss buffers and
// stall the loads the multiplies wait on).
struct Prefetch {
  const char* next;
  const char* end;
  int64_t lines, steps, credit = 0;
  PDS_F32_TARGET inline void step() {
    for (credit += lines; credit >= steps && next < end; credit -= steps, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// R rows of x (from `a`, row stride lda) against one chunk of `kc` K values of a panel (`b`, 64
// values a K row), into the R x 64 block of y at `c` (row stride ldc): the first chunk starts the
// sums, a later one adds to what the chunk before it stored; the last one also adds `bias` (else null).
template <int R>
PDS_F32_TARGET inline void tile(const float* a, int64_t lda, const float* b, int64_t kc, float* c, int64_t ldc,
                                bool first, const float* bias, Prefetch& pf) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * j);
  }
  for (int64_t k = 0; k < kc; ++k) {
    pf.step();
    const float* bk = b + k * kCols;
    const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16);
    const __m512 b2 = _mm512_loadu_ps(bk + 32), b3 = _mm512_loadu_ps(bk + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(x, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      __m512 v = acc[r][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      _mm512_storeu_ps(c + r * ldc + 16 * j, v);
    }
  }
}

PDS_F32_TARGET void tile_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t kc, float* c,
                              int64_t ldc, bool first, const float* bias, Prefetch& pf) {
  switch (rows) {
    case 6: tile<6>(a, lda, b, kc, c, ldc, first, bias, pf); break;
    case 5: tile<5>(a, lda, b, kc, c, ldc, first, bias, pf); break;
    case 4: tile<4>(a, lda, b, kc, c, ldc, first, bias, pf); break;
    case 3: tile<3>(a, lda, b, kc, c, ldc, first, bias, pf); break;
    case 2: tile<2>(a, lda, b, kc, c, ldc, first, bias, pf); break;
    default: tile<1>(a, lda, b, kc, c, ldc, first, bias, pf); break;
  }
}

// The panels [first, last) for every row of x, on this thread, a slice of kSliceRows rows at a
// time. Within a panel K goes in chunks, each over all row tiles of the slice before the next, so
// the chunk's 32 KB stay in L1 while every tile uses them; the next panel's weights are fetched
// into L2 meanwhile, spread evenly over the tile steps, so the memory stream never waits for the
// multiplies.
PDS_F32_TARGET void panels(const Problem& p, int64_t first, int64_t last) {
  const int64_t panel_floats = p.K * kCols, panel_lines = panel_floats * 4 / 64;
  const int64_t chunks = (p.K + kChunk - 1) / kChunk;
  for (int64_t m0 = 0; m0 < p.M; m0 += kSliceRows) {
    const int64_t m1 = std::min(p.M, m0 + kSliceRows);
    const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
    for (int64_t panel = first; panel < last; ++panel) {
      const float* w = p.w + panel * panel_floats;
      // the next panel of this pass, or the first of the next slice's pass
      const int64_t next = panel + 1 < last ? panel + 1 : (m1 < p.M ? first : -1);
      const char* prefetch = next < 0 ? nullptr : reinterpret_cast<const char*>(p.w + next * panel_floats);
      Prefetch pf{prefetch, prefetch == nullptr ? nullptr : prefetch + panel_lines * 64, panel_lines, tiles * p.K};
      const float* bias = p.bias == nullptr ? nullptr : p.bias + panel * kCols;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * kChunk, kc = std::min(kChunk, p.K - k0);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t row = m0 + t * kTileRows;
          tile_rows(std::min(kTileRows, m1 - row), p.x + row * p.lda + k0, p.lda, w + k0 * kCols, kc,
                    p.y + row * p.N + panel * kCols, p.N, c == 0, c + 1 == chunks ? bias : nullptr, pf);
        }
      }
    }
  }
}
#endif

bool f32_linear_available() {
#ifdef PDS_F32_LINEAR
  return pds::cpu_has_avx512();
#else
  return false;
#endif
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(f32_linear_available(), "f32_linear: this CPU or build has no AVX-512 kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x: [M, K] float32 expected");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x: rows must be contiguous");
  TORCH_CHECK(packed.is_mkldnn() && packed.scalar_type() == at::kFloat && packed.dim() == 2,
              "packed: a float32 weight from mkldnn._reorder_linear_weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(N % kCols == 0 && K > 0, "f32_linear: N must be a multiple of 64 and K positive");
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kFloat && b.is_contiguous()),
              "bias: [N] contiguous float32 expected");
  int64_t nbytes = 0;
  const float* w = static_cast<const float*>(pds::mkldnn_bytes(packed, nbytes));
  TORCH_CHECK(nbytes == N * K * 4, "packed weight of ", nbytes, " bytes is not an unpadded [N, K] float32 panel layout");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PDS_F32_LINEAR
  const Problem p{x.data_ptr<float>(), x.stride(0), w, b.defined() ? b.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), M, N, K};
  const int64_t panel_count = N / kCols;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // an even split of the panels: each thread streams its own share of the weights once per slice
  at::parallel_for(0, panel_count, (panel_count + threads - 1) / threads,
                   [&](int64_t first, int64_t last) { panels(p, first, last); });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("f32_linear_available() -> bool", &f32_linear_available);
  // no dispatch key: the weight is an MkldnnCPU tensor and x a CPU one
  m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &f32_linear);
}
