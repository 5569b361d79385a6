// A bfloat16 linear on AMX tiles for decode steps and prompt chunks of up to ~1000 rows:
// y[M, N] = x[M, K] . W[N, K]^T (+ bias),
// float32 accumulation, one rounding to bfloat16, as oneDNN's bf16 GEMM computes it.
//
// Why: a decode step's linears multiply a few to a few hundred rows by every weight of the model.
// oneDNN's AMX kernel ran them at 8.2-19 ms per bench-model step (1-256 rows, 2 cores of a
// Sapphire Rapids guest) where streaming the 172 MB of weights takes ~7 ms; this one keeps each
// weight block in cache for every row of the batch, fetches the next block into L2 while it
// computes, and ran 1.11-1.22x faster at most row counts up to 1024 (1.0x at 64, 0.97x at 256;
// `python -m benchmarks.amx_linear`). oneDNN is faster for long prompt chunks (1.07x at 2048
// rows), so the caller (pdserve/engine/layers.py `Linear`) sends only up to `AMX_MAX_ROWS` rows here.
//
// The weight is the one oneDNN already holds, prepacked by `torch.ops.mkldnn._reorder_linear_weight`:
// on an AMX CPU its blocked layout (oneDNN's AB16b32a2b) is [N/32][K/32][16][32][2], which is two
// AMX B tiles side by side: tile row r holds K pairs (2r, 2r+1) of 32 output columns. So no second
// copy of the weights exists; `Linear` checks that layout bit for bit against the checkpoint's
// weight before it sends anything here, and this op checks sizes.
//
// Tiles: C0..C3 accumulate a 32x32 float32 block (two row tiles x two column tiles), A4/A5 hold 16
// rows x 32 K of x each, B6/B7 the matching 32 K x 16 columns of W. Work is split over threads by
// 32-column blocks; each thread walks its blocks in order, once per 512-row slice of x, so a decode
// step streams the weights once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu_common.h"
#include "cpu_packed.h"
#include "cpu_amx.h"

#if defined(PDS_X86_GCC) && __GNUC__ >= 11
#define PDS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRows = 16;        // rows of an A or C tile
constexpr int64_t kKBlock = 32;      // K values in one tile row of A (bf16, 64 bytes)
constexpr int64_t kCols = 32;        // output columns of one packed block: two C tiles
constexpr int64_t kBlock = kKBlock * kCols;  // bf16 values in one [16][32][2] packed block

struct Problem {
  const uint16_t* x;     // [M, lda] bf16 bits, K used
  int64_t lda;
  const uint16_t* tail;  // the last, partial row tile of x padded with zero rows: [16, K], or null
  const uint16_t* w;     // packed [N/32][K/32][16][32][2]
  const uint16_t* bias;  // [N] or null
  uint16_t* y;           // [M, N]
  int64_t M, N, K;
};

#ifdef PDS_AMX
#define PDS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

// One row tile (kTwo = false) or two of x against one 32-column block of W, over K blocks
// [k_first, k_last). The float32 sums carry over from one K chunk to the next in `partial` (this
// tile pair's 32 x 32 block); after the last chunk they go out rounded to bf16 (vcvtne2ps2bf16: to
// nearest even, as torch rounds; it reads float32 subnormals as 0, which a sum of bf16 products of
// model weights does not produce in practice).
template <bool kTwo>
PDS_AMX_TARGET inline void row_tiles(const Problem& p, int64_t tile, int64_t block, int64_t k_first, int64_t k_last,
                                     float* partial, const char*& prefetch, const char* prefetch_end,
                                     int64_t prefetch_step) {
  const int64_t k_blocks = p.K / kKBlock;
  const uint16_t* panel = p.w + block * k_blocks * kBlock;
  const int64_t full_tiles = p.M / kRows;
  auto a_of = [&](int64_t t, int64_t& stride) {
    stride = t < full_tiles ? p.lda * 2 : p.K * 2;
    return t < full_tiles ? p.x + t * kRows * p.lda : p.tail;
  };
  int64_t s0 = 0, s1 = 0;
  const uint16_t* a0 = a_of(tile, s0);
  const uint16_t* a1 = kTwo ? a_of(tile + 1, s1) : nullptr;
  float* const lower = partial + kRows * kCols;  // the second row tile's sums
  if (k_first == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, partial, kCols * 4);
    _tile_loadd(1, partial + 16, kCols * 4);
    if (kTwo) {
      _tile_loadd(2, lower, kCols * 4);
      _tile_loadd(3, lower + 16, kCols * 4);
    }
  }
  for (int64_t kb = k_first; kb < k_last; ++kb) {
    for (int64_t i = 0; i < prefetch_step && prefetch < prefetch_end; ++i, prefetch += 64) {
      _mm_prefetch(prefetch, _MM_HINT_T1);
    }
    const uint16_t* b = panel + kb * kBlock;
    _tile_loadd(4, a0 + kb * kKBlock, s0);
    _tile_loadd(6, b, kCols * 4);  // columns 0-15: the first 64 bytes of each 128-byte row
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + kCols, kCols * 4);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwo) {
      _tile_loadd(5, a1 + kb * kKBlock, s1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, partial, kCols * 4);
  _tile_stored(1, partial + 16, kCols * 4);
  if (kTwo) {
    _tile_stored(2, lower, kCols * 4);
    _tile_stored(3, lower + 16, kCols * 4);
  }
  if (k_last < k_blocks) return;
  __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
  if (p.bias != nullptr) {
    const __m256i* bias = reinterpret_cast<const __m256i*>(p.bias + block * kCols);
    bias_lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(bias)), 16));
    bias_hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(bias + 1)), 16));
  }
  const int64_t rows = std::min<int64_t>(kTwo ? 2 * kRows : kRows, p.M - tile * kRows);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(partial + r * kCols), bias_lo);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(partial + r * kCols + 16), bias_hi);
    _mm512_storeu_si512(p.y + (tile * kRows + r) * p.N + block * kCols, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The column blocks [first, last) for every row of x, on this thread, a slice of kSliceRows rows
// at a time (x's slice, ~800 KB at K=768, stays in this core's L2 while the blocks pass). K goes in
// chunks of kChunkBlocks, each over all row tiles of the slice before the next: a chunk's 16 KB of
// weights stay in L1 while every row tile uses them, so only x's tiles come from L2. Over all of K
// at once, both operands streamed from L2 for every product (1.23 against 1.51 TFLOP/s on one
// core, 128 rows x 768 x 768 in cache).
PDS_AMX_TARGET void column_blocks(const Problem& p, int64_t first, int64_t last) {
  constexpr int64_t kChunkBlocks = 8, kSliceRows = 512;
  const pds::TileConfig config = pds::full_tiles();  // kRows rows of 64 bytes
  _tile_loadconfig(&config);
  const int64_t k_blocks = p.K / kKBlock;
  const int64_t panel_bytes = k_blocks * kBlock * 2;
  // each tile pair's float32 block, 64-byte aligned; written before it is read, so not zeroed
  const int64_t pair_rows = (std::min(p.M, kSliceRows) + 2 * kRows - 1) / (2 * kRows) * (2 * kRows);
  std::unique_ptr<float[]> sums(new float[pair_rows * kCols + 16]);
  float* const partials = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sums.get()) + 63) & ~uintptr_t{63});
  for (int64_t m0 = 0; m0 < p.M; m0 += kSliceRows) {
    const int64_t tile_first = m0 / kRows, tile_end = (std::min(p.M, m0 + kSliceRows) + kRows - 1) / kRows;
    const int64_t pairs = (tile_end - tile_first + 1) / 2;
    // the next block's weights are fetched into L2 while this one computes, spread evenly over its
    // tile steps, so the memory stream never stops for the tile loads (1.1-1.25x for 1-32 rows)
    const int64_t steps = pairs * k_blocks;
    const int64_t prefetch_step = (panel_bytes / 64 + steps - 1) / steps;
    for (int64_t block = first; block < last; ++block) {
      const char* prefetch = reinterpret_cast<const char*>(p.w + (block + 1) * k_blocks * kBlock);
      const char* prefetch_end = block + 1 < last ? prefetch + panel_bytes : prefetch;
      for (int64_t k_first = 0; k_first < k_blocks; k_first += kChunkBlocks) {
        const int64_t k_last = std::min(k_blocks, k_first + kChunkBlocks);
        int64_t tile = tile_first;
        for (; tile + 1 < tile_end; tile += 2) {
          row_tiles<true>(p, tile, block, k_first, k_last, partials + (tile - tile_first) * kRows * kCols, prefetch,
                          prefetch_end, prefetch_step);
        }
        if (tile < tile_end) {
          row_tiles<false>(p, tile, block, k_first, k_last, partials + (tile - tile_first) * kRows * kCols,
                           prefetch, prefetch_end, prefetch_step);
        }
      }
    }
  }
  _tile_release();
}
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(pds::amx_ready(), "amx_linear: this CPU or kernel has no AMX bf16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x: [M, K] bfloat16 expected");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x: rows must be contiguous");
  TORCH_CHECK(packed.is_mkldnn() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 2,
              "packed: a bfloat16 weight from mkldnn._reorder_linear_weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(N % kCols == 0 && K % kKBlock == 0 && K > 0, "amx_linear: N and K must be positive multiples of 32");
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kBFloat16 && b.is_contiguous()),
              "bias: [N] contiguous bfloat16 expected");
  int64_t nbytes = 0;
  const uint16_t* w = static_cast<const uint16_t*>(pds::mkldnn_bytes(packed, nbytes));
  TORCH_CHECK(nbytes == N * K * 2, "packed weight of ", nbytes, " bytes is not an unpadded [N, K] bf16 block layout");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor tail;
  if (M % kRows != 0) {  // tile loads read 16 rows: the last tile's rows come from a padded copy
    tail = at::zeros({kRows, K}, x.options());
    tail.narrow(0, 0, M % kRows).copy_(x.narrow(0, M - M % kRows, M % kRows));
  }
  Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()),
            x.stride(0),
            tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr,
            w,
            b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr,
            reinterpret_cast<uint16_t*>(y.data_ptr()),
            M,
            N,
            K};
#ifdef PDS_AMX
  const int64_t blocks = N / kCols;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // an even split of the column blocks: each thread streams its own share of the weights once
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads,
                   [&](int64_t first, int64_t last) { column_blocks(p, first, last); });
#endif
  return y;
}

}  // namespace

namespace pds {

// Whether this process may use AMX bf16 tiles: the CPU has them (CPUID 7.0:EDX bits 22 and 24, plus
// AVX512-BF16 for the output rounding), and Linux granted the tile data state (ARCH_REQ_XCOMP_PERM,
// once per process; a kernel without AMX support refuses it).
bool amx_ready() {
#ifdef PDS_AMX
  static const bool yes = [] {
    if (!pds::cpu_has_avx512()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7) return false;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
    const bool avx512_bf16 = (a >> 5) & 1;
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace pds

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("amx_available() -> bool", &pds::amx_ready);
  // no dispatch key: the weight is an MkldnnCPU tensor and x a CPU one
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear);
}
