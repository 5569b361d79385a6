// Attention for prompts in bfloat16 on AMX tiles: many query tokens of a sequence at once, over its
// K/V pages.
//
// Why: in bf16 the prompt attention ran on torch's flash SDPA, at about 0.2 TFLOP/s on 2 Sapphire
// Rapids cores (1.1 s of a 12 s benchmark run), where one core's tiles multiply at ~3 TFLOP/s. The
// AVX-512 prompt kernel (cpu_prefill_attention.cpp) computes in float32 and was 2x slower than SDPA
// in bf16; this one puts both products on the tiles and keeps the softmax lane-wise, and ran 2.4-3.3x
// faster than SDPA on 64-512-token prompts of the bench model (`python -m benchmarks.attention_kernel
// --against sdpa`; in the engine's bf16 benchmark run, prompt attention went from 1.10 to 0.34 s).
//
// Layout: the queries are the lanes. A work item is 16 query rows ((token, head) pairs of one kv
// head's group). For each chunk of 32 keys:
//   S^T [32 keys x 16 queries] = K . Q^T on the tiles: A = 16 key rows as they lie (packed K), B = the
//     item's queries, transposed once per item into the tiles' pair layout;
//   the online softmax reads S^T's rows as 16-lane vectors, one lane per query, so the max, exp and
//     sum need no horizontal reductions;
//   O^T [D x 16 queries] += V^T . P^T on the tiles: A = V transposed (packed once per unit of items),
//     B = the probabilities, rounded to bf16 with each key pair interleaved (the tiles' pair layout).
// O^T stays in the tiles across chunks when D <= 64 (4 tiles); wider heads keep it in a float32
// buffer that each chunk loads and stores. The running max is moved lazily: the product is rescaled
// only when a chunk's max passes the one in use by more than 2^12 (the softmax runs in base 2), so
// the probabilities stay below 4096 and most chunks need no rescale (FlashAttention-4's rule).
//
// Masks as in the AVX-512 kernel: query j (position p) sees keys 0..p, and with a sliding window W
// only those above p - W; chunks wholly inside every row's range skip the mask. Sinks (gpt-oss) join
// each row's sum once, after the last chunk.
//
// Needs AMX bf16 (Sapphire Rapids or later; `pds::amx_ready`) and a head size that is a multiple of 32
// up to 256 (`pds::amx_prefill_supported`); elsewhere bf16 prompts keep SDPA. Products and sums in
// float32, P rounded to bf16 before P.V as SDPA's bf16 path rounds it; output rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_prefill.h"

#if defined(PDS_X86_GCC) && __GNUC__ >= 11
#define PDS_AMX_PREFILL 1
#include <immintrin.h>
#endif

#ifdef PDS_AMX_PREFILL
namespace {

#define PDS_AMX_ATTN_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

constexpr int64_t kQ = 16;     // query rows per item: the vector lanes, and the columns of a C tile
constexpr int64_t kKeys = 32;  // keys per chunk: two row tiles of S^T, one K-step of P^T
constexpr int64_t kMaxD = 256;
constexpr int64_t kOTiles = 4;   // O^T tiles that stay in the tiles (D <= 64)
constexpr float kLazyMax2 = 12.0f;  // rescale only when a chunk's max passes the one in use by 2^12

// A run of consecutive items of one (sequence, kv head), and the keys they need, packed once.
struct Unit {
  int32_t seq, head, row_first, row_end;  // query rows [row_first, row_end) of the group's rows
  int64_t key_first, key_end;             // keys [key_first, key_end) packed; key_first a multiple of 32
};

// Per-thread buffers; the packed keys grow to the largest unit of the thread's range.
struct Scratch {
  std::vector<uint16_t> k;    // [chunks * 32][D]: the unit's keys, rows contiguous, zero past key_end
  std::vector<uint16_t> vt;   // [chunks][D / 16][16][32]: V transposed, one A tile per (chunk, 16 dims)
  alignas(64) uint32_t qt[kMaxD / 32][16][kQ];  // B tiles of Q^T: [d pair][query] of bf16 pairs
  alignas(64) float s[2][kKeys][kQ];             // S^T of two chunks (the loop is pipelined)
  alignas(64) uint32_t p[2][kKeys / 2][kQ];      // P^T in bf16 pairs: B tiles of two chunks
  alignas(64) float o[kMaxD][kQ];                // O^T when it is not in the tiles, and at the end
};

// 2^x lane-wise: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor polynomial to degree 5
// (relative error under 3e-6, far below the bf16 rounding of the probabilities it makes), times 2^n by
// vscalefps; 0 below -126 (a masked key's -inf, and an unused row's first rescale).
PDS_AMX_ATTN_TARGET inline __m512 exp2_16(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);                     // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));    // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));    // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));    // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));    // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// The 16 rows of one item: row r is query head h*g + (row0 + r) % g of token (row0 + r) / g.
struct ItemRows {
  int64_t rows, min_pos, max_pos;
  int32_t pos[kQ];        // position of each row in its sequence; -1 for padding rows
  const uint16_t* q[kQ];  // each row's query vector (null for padding rows)
  uint16_t* out[kQ];      // where each row's output goes
  float sink2[kQ];        // each row's head's sink logit in the softmax's base-2 units (with sinks; 0 else)
};

ItemRows item_rows(const pds::PrefillProblem& pb, int64_t s, int64_t h, int64_t row0, int64_t row_end) {
  const int64_t g = pb.hq / pb.hkv, q_len = pb.qstart[s + 1] - pb.qstart[s], first_pos = pb.ctx[s] - q_len;
  ItemRows it{std::min<int64_t>(kQ, row_end - row0), 0, 0, {}, {}, {}, {}};
  const uint16_t* q = static_cast<const uint16_t*>(pb.q);
  uint16_t* out = static_cast<uint16_t*>(pb.out);
  int64_t t = row0 / g, i = row0 % g;
  for (int64_t r = 0; r < kQ; ++r) {
    const bool real = r < it.rows;
    it.pos[r] = real ? static_cast<int32_t>(first_pos + t) : -1;
    it.q[r] = real ? q + (pb.qstart[s] + t) * pb.q_row + (h * g + i) * pb.d : nullptr;
    it.out[r] = real ? out + ((pb.qstart[s] + t) * pb.hq + h * g + i) * pb.d : nullptr;
    it.sink2[r] = real && pb.sinks ? pb.sinks[h * g + i] * 1.44269504088896341f : 0.0f;
    if (++i == g) {
      i = 0;
      ++t;
    }
  }
  it.min_pos = it.pos[0];
  it.max_pos = it.pos[it.rows - 1];
  return it;
}

// r[i] (16 rows of 16 dwords) becomes its transpose: r[j][i] = old r[i][j]. Unpacks give each 128-bit
// lane a 4x4 block of the result; the lanes are then moved between registers.
PDS_AMX_ATTN_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[4][4];  // u[G][j]: lane L holds column 4L + j of rows 4G .. 4G + 3
  for (int gr = 0; gr < 4; ++gr) {
    u[gr][0] = _mm512_unpacklo_epi64(t[4 * gr], t[4 * gr + 2]);
    u[gr][1] = _mm512_unpackhi_epi64(t[4 * gr], t[4 * gr + 2]);
    u[gr][2] = _mm512_unpacklo_epi64(t[4 * gr + 1], t[4 * gr + 3]);
    u[gr][3] = _mm512_unpackhi_epi64(t[4 * gr + 1], t[4 * gr + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0x44), v1 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0x44), v3 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// The unit's keys from the pages: K rows into s.k, V transposed into s.vt, zero past key_end. V^T's
// tile for 32 keys and 16 dims holds in row d the 16 key pairs (V[2j][d], V[2j + 1][d]) as dwords:
// two key rows interleaved value by value give those pairs for 16 dims at once, and 16 such vectors
// (one per key pair) transposed as dwords are the tile.
PDS_AMX_ATTN_TARGET void pack_keys(const pds::PrefillProblem& pb, const Unit& u, Scratch& s) {
  const int64_t d = pb.d, chunks = (u.key_end - u.key_first + kKeys - 1) / kKeys, dblocks = d / 16;
  s.k.resize(chunks * kKeys * d);
  s.vt.resize(chunks * dblocks * 16 * kKeys);
  const int64_t head_stride = pb.bs * d, kv_stride = pb.hkv * head_stride;
  const int64_t block_stride = pb.planes * kv_stride, v_off = (pb.planes - 1) * kv_stride;  // one plane: V = K
  const uint16_t* kv = static_cast<const uint16_t*>(pb.kv);
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* vrows[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t key = u.key_first + c * kKeys + j;
      uint16_t* kdst = s.k.data() + (c * kKeys + j) * d;
      if (key < u.key_end) {
        const int64_t block = pb.table[u.seq * pb.max_pages + key / pb.bs];
        const uint16_t* krow = kv + block * block_stride + u.head * head_stride + (key % pb.bs) * d;
        std::memcpy(kdst, krow, d * sizeof(uint16_t));
        vrows[j] = krow + v_off;
      } else {
        std::memset(kdst, 0, d * sizeof(uint16_t));
        vrows[j] = nullptr;
      }
    }
    for (int64_t half = 0; half < d / 32; ++half) {  // dims half*32 .. half*32 + 31: two tiles
      __m512i lo[16], hi[16];
      for (int64_t j = 0; j < kKeys / 2; ++j) {
        const uint16_t *a = vrows[2 * j], *b = vrows[2 * j + 1];
        const __m512i va = a ? _mm512_loadu_si512(a + half * 32) : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_loadu_si512(b + half * 32) : _mm512_setzero_si512();
        lo[j] = _mm512_permutex2var_epi16(va, low, vb);
        hi[j] = _mm512_permutex2var_epi16(va, high, vb);
      }
      transpose16(lo);
      transpose16(hi);
      uint16_t* tile = s.vt.data() + (c * dblocks + 2 * half) * 16 * kKeys;
      for (int64_t x = 0; x < 16; ++x) {
        _mm512_storeu_si512(tile + x * kKeys, lo[x]);
        _mm512_storeu_si512(tile + (16 + x) * kKeys, hi[x]);
      }
    }
  }
}

// O^T *= alpha, lane-wise, over the D rows of s.o
PDS_AMX_ATTN_TARGET inline void scale_rows(Scratch& s, int64_t d, __m512 alpha) {
  for (int64_t x = 0; x < d; ++x) _mm512_store_ps(s.o[x], _mm512_mul_ps(_mm512_load_ps(s.o[x]), alpha));
}

// O^T's tiles 0..B-1 (B = 2 or 4: D = 32 or 64) zeroed, stored to s.o or loaded from it; tile
// numbers are immediates, hence one line per tile
enum class TileOp { kZero, kStore, kLoad };
template <int64_t B>
PDS_AMX_ATTN_TARGET inline void o_tiles(TileOp op, Scratch& s) {
  static_assert(B == 2 || B == 4, "O^T stays in the tiles for D = 32 or 64 only");
  if (op == TileOp::kZero) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (B == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else if (op == TileOp::kStore) {
    _tile_stored(0, s.o[0], 64);
    _tile_stored(1, s.o[16], 64);
    if constexpr (B == 4) {
      _tile_stored(2, s.o[32], 64);
      _tile_stored(3, s.o[48], 64);
    }
  } else {
    _tile_loadd(0, s.o[0], 64);
    _tile_loadd(1, s.o[16], 64);
    if constexpr (B == 4) {
      _tile_loadd(2, s.o[32], 64);
      _tile_loadd(3, s.o[48], 64);
    }
  }
}

// One item's state between the steps of its chunk loop.
template <int64_t D>
struct ItemState {
  const pds::PrefillProblem& pb;
  const Unit& u;
  Scratch& s;
  ItemRows it;
  int64_t lo;
  __m512i pos;
  __m512 m = _mm512_set1_ps(-1e30f);  // the max in use, scaled; finite, so a row with no key yet stays NaN-free
  __m512 l = _mm512_setzero_ps();     // the sum of the probabilities under m
  bool o_zero = true;                 // nothing accumulated yet: a rescale has nothing to scale
};

// S^T of chunk c = K . Q^T, its two 16-key row tiles, into dst (float32 [32 keys][16 queries])
template <int64_t D>
PDS_AMX_ATTN_TARGET inline void chunk_scores(ItemState<D>& st, int64_t c, float (*dst)[kQ]) {
  _tile_zero(4);
  _tile_zero(5);
  const uint16_t* krows = st.s.k.data() + c * kKeys * D;
#pragma GCC unroll 8
  for (int64_t dp = 0; dp < D / 32; ++dp) {
    _tile_loadd(7, st.s.qt[dp], 64);
    _tile_loadd(6, krows + dp * 32, D * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, krows + 16 * D + dp * 32, D * 2);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, dst[0], 64);
  _tile_stored(5, dst[16], 64);
}

// The online softmax of chunk c's scores, lane-wise: masks, the lazy max (rescaling what O^T holds,
// which must be every earlier chunk's product), the probabilities into pt as bf16 key pairs
template <int64_t D>
PDS_AMX_ATTN_TARGET inline void chunk_softmax(ItemState<D>& st, int64_t c, float (*src)[kQ], uint32_t (*pt)[kQ]) {
  constexpr int64_t kDBlocks = D / 16;
  const pds::PrefillProblem& pb = st.pb;
  const int64_t k0 = st.u.key_first + c * kKeys;
  // scores go to base 2: p = 2^(s * scale * log2(e) - m), m kept in the same units
  const __m512 scale = _mm512_set1_ps(pb.scale * 1.44269504088896341f), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const bool full = k0 + kKeys - 1 <= st.it.min_pos && (pb.window <= 0 || k0 > st.it.max_pos - pb.window);
  __m512 sv[kKeys];
  __m512 cmax = neg_inf;
#pragma GCC unroll 32
  for (int64_t j = 0; j < kKeys; ++j) {
    sv[j] = _mm512_load_ps(src[j]);
    if (!full) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + j));
      __mmask16 ok = _mm512_cmp_epi32_mask(key, st.pos, _MM_CMPINT_LE);
      if (pb.window > 0)
        ok &= _mm512_cmp_epi32_mask(key, _mm512_sub_epi32(st.pos, _mm512_set1_epi32(static_cast<int32_t>(pb.window))),
                                    _MM_CMPINT_NLE);
      sv[j] = _mm512_mask_blend_ps(ok, neg_inf, sv[j]);
    }
    cmax = _mm512_max_ps(cmax, sv[j]);
  }
  const __m512 cm = _mm512_mul_ps(cmax, scale);
  if (_mm512_cmp_ps_mask(cm, _mm512_add_ps(st.m, _mm512_set1_ps(kLazyMax2)), _CMP_GT_OQ)) {
    const __m512 m_new = _mm512_max_ps(st.m, cm);
    const __m512 alpha = exp2_16(_mm512_sub_ps(st.m, m_new));
    st.l = _mm512_mul_ps(st.l, alpha);
    st.m = m_new;
    if (!st.o_zero) {
      if constexpr (kDBlocks <= kOTiles) o_tiles<kDBlocks>(TileOp::kStore, st.s);
      scale_rows(st.s, D, alpha);
      if constexpr (kDBlocks <= kOTiles) o_tiles<kDBlocks>(TileOp::kLoad, st.s);
    }
  }
  // element 2n of a pair row from key 2r's lane n, 2n + 1 from key 2r + 1's
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int64_t r = 0; r < kKeys / 2; ++r) {
    const __m512 p0 = exp2_16(_mm512_fmsub_ps(sv[2 * r], scale, st.m));
    const __m512 p1 = exp2_16(_mm512_fmsub_ps(sv[2 * r + 1], scale, st.m));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_store_si512(pt[r], _mm512_permutexvar_epi16(interleave, halves));
  }
  st.l = _mm512_add_ps(st.l, sum);
}

// O^T += V^T . P^T for chunk c
template <int64_t D>
PDS_AMX_ATTN_TARGET inline void chunk_accumulate(ItemState<D>& st, int64_t c, uint32_t (*pt)[kQ]) {
  constexpr int64_t kDBlocks = D / 16;
  _tile_loadd(7, pt, 64);
  const uint16_t* vt = st.s.vt.data() + c * kDBlocks * 16 * kKeys;
  if constexpr (kDBlocks <= kOTiles) {
    _tile_loadd(6, vt, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, vt + 16 * kKeys, 64);
    _tile_dpbf16ps(1, 6, 7);
    if constexpr (kDBlocks == 4) {
      _tile_loadd(6, vt + 2 * 16 * kKeys, 64);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, vt + 3 * 16 * kKeys, 64);
      _tile_dpbf16ps(3, 6, 7);
    }
  } else {
    for (int64_t b = 0; b < kDBlocks; ++b) {
      _tile_loadd(0, st.s.o[b * 16], 64);
      _tile_loadd(6, vt + b * 16 * kKeys, 64);
      _tile_dpbf16ps(0, 6, 7);
      _tile_stored(0, st.s.o[b * 16], 64);
    }
  }
  st.o_zero = false;
}

// The item of 16 query rows from row0. The chunk loop is software-pipelined: step c computes chunk c's
// scores on the tiles, adds chunk c - 2's product into O^T, then runs chunk c - 1's softmax on the
// vector units, so that no step reads what the step before it has just stored (a tile store read back
// by vector loads, or the reverse, stalled the loop), and the tiles and the vector units overlap. The
// product goes in before the softmax that may rescale O^T, so O^T then holds every earlier chunk.
template <int64_t D>
PDS_AMX_ATTN_TARGET void attend_item(const pds::PrefillProblem& pb, const Unit& u, int64_t row0, Scratch& s) {
  constexpr int64_t kDBlocks = D / 16, kDPairs = D / 32;
  ItemState<D> st{pb, u, s, item_rows(pb, u.seq, u.head, row0, u.row_end), 0, _mm512_setzero_si512()};
  const ItemRows& it = st.it;
  // the queries, transposed into B tiles: qt[d / 32][d pair][query] = (q[2p], q[2p + 1]) as one uint32
  for (int64_t dp = 0; dp < kDPairs; ++dp) {
    __m512i rows[16];
    for (int64_t r = 0; r < kQ; ++r)
      rows[r] = r < it.rows ? _mm512_loadu_si512(it.q[r] + dp * 32) : _mm512_setzero_si512();
    transpose16(rows);
    for (int64_t x = 0; x < 16; ++x) _mm512_store_si512(s.qt[dp][x], rows[x]);
  }
  st.lo = pb.window > 0 ? std::max<int64_t>(0, it.min_pos - pb.window + 1) : 0;
  st.pos = _mm512_loadu_si512(it.pos);
  const int64_t c_first = (std::max(st.lo, u.key_first) - u.key_first) / kKeys;
  const int64_t c_last = (it.max_pos - u.key_first) / kKeys;
  if constexpr (kDBlocks <= kOTiles) {
    o_tiles<kDBlocks>(TileOp::kZero, s);
  } else {
    std::memset(s.o, 0, sizeof(float) * D * kQ);
  }
  for (int64_t c = c_first; c <= c_last + 2; ++c) {
    if (c <= c_last) chunk_scores(st, c, s.s[c & 1]);
    if (c - 2 >= c_first) chunk_accumulate(st, c - 2, s.p[c & 1]);
    if (c - 1 >= c_first && c - 1 <= c_last) chunk_softmax(st, c - 1, s.s[(c - 1) & 1], s.p[(c - 1) & 1]);
  }
  if constexpr (kDBlocks <= kOTiles) o_tiles<kDBlocks>(TileOp::kStore, s);
  // out = O / l, transposed back to [token][head][dim]; every real row saw at least its own key
  alignas(64) float inv[kQ];
  if (pb.sinks) {
    // A sink is one more term of the denominator with no value, taken once here: the max moves to it
    // where it is larger (it may pass every score), rescaling O and l, so that neither overflows;
    // out = O * alpha / (l * alpha + 2^(sink - max)), in the same base-2 units as m.
    const __m512 sink = _mm512_loadu_ps(it.sink2), m_new = _mm512_max_ps(st.m, sink);
    const __m512 alpha = exp2_16(_mm512_sub_ps(st.m, m_new));
    const __m512 denom = _mm512_fmadd_ps(st.l, alpha, exp2_16(_mm512_sub_ps(sink, m_new)));
    _mm512_store_ps(inv, _mm512_div_ps(alpha, denom));
  } else {
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), st.l));
  }
  for (int64_t b = 0; b < kDBlocks; ++b) {
    __m512i cols[16];
    for (int64_t x = 0; x < 16; ++x) cols[x] = _mm512_load_si512(s.o[b * 16 + x]);
    transpose16(cols);  // cols[r]: dims b*16 .. b*16 + 15 of query row r
    for (int64_t r = 0; r < it.rows; ++r) {
      uint16_t* dst = it.out[r] + b * 16;
      const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(cols[r]), _mm512_set1_ps(inv[r]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

template <int64_t D>
PDS_AMX_ATTN_TARGET void attend_units(const pds::PrefillProblem& pb, const Unit* units, int64_t n, Scratch& s) {
  const pds::TileConfig config = pds::full_tiles();
  _tile_loadconfig(&config);
  for (int64_t i = 0; i < n; ++i) {
    pack_keys(pb, units[i], s);
    for (int64_t row0 = units[i].row_first; row0 < units[i].row_end; row0 += kQ) attend_item<D>(pb, units[i], row0, s);
  }
  _tile_release();
}

void run(const pds::PrefillProblem& pb) {
  // units: runs of one (sequence, kv head)'s query rows, costed by rows x keys. A unit packs its keys
  // once, so a unit is a whole group where there are enough groups to share among the threads, and a
  // part of one otherwise (a single prompt of a one-kv-head model still runs on every thread)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups = pb.num_seqs * pb.hkv;
  if (groups == 0) return;  // no sequence: nothing to write
  const int64_t parts = (2 * threads + groups - 1) / groups;
  std::vector<int64_t> cost_before;
  const auto unit_rows = [&](int64_t rows) { return (rows + parts * kQ - 1) / (parts * kQ) * kQ; };
  std::vector<Unit> units;
  for (const pds::RowSpan& span : pds::row_spans(pb, unit_rows, cost_before))
    units.push_back({span.seq, span.head, span.row0, span.row_end, span.lo / kKeys * kKeys, span.max_pos + 1});
  const std::vector<int64_t> bounds = pds::cost_bounds(cost_before, threads);
  const int64_t ranges = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    auto s = std::make_unique<Scratch>();
    for (int64_t r = first; r < last; ++r) {
      const Unit* us = units.data() + bounds[r];
      const int64_t n = bounds[r + 1] - bounds[r];
      switch (pb.d) {
        case 32: attend_units<32>(pb, us, n, *s); break;
        case 64: attend_units<64>(pb, us, n, *s); break;
        case 96: attend_units<96>(pb, us, n, *s); break;
        case 128: attend_units<128>(pb, us, n, *s); break;
        case 160: attend_units<160>(pb, us, n, *s); break;
        case 192: attend_units<192>(pb, us, n, *s); break;
        case 224: attend_units<224>(pb, us, n, *s); break;
        default: attend_units<256>(pb, us, n, *s); break;
      }
    }
  });
}

}  // namespace

namespace pds {

bool amx_prefill_supported(int64_t d) { return amx_ready() && d % 32 == 0 && d > 0 && d <= kMaxD; }
void prefill_attention_amx(const PrefillProblem& pb) { run(pb); }

}  // namespace pds
#else
namespace pds {

bool amx_prefill_supported(int64_t) { return false; }
void prefill_attention_amx(const PrefillProblem&) { TORCH_CHECK(false, "no AMX prompt kernel in this build"); }

}  // namespace pds
#endif
