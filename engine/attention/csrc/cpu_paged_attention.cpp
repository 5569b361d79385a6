// Paged attention on CPU that reads K/V pages of the pool in place.
//
// Pool layer layout (HND inside a block): kv[N, 2, Hkv, B, D].
// For every sequence s, its query tokens q[query_start[s] .. query_start[s+1])
// sit at the last positions of its context (context_lens[s]); query j attends
// causally to keys 0 .. ctx - q_len + j, found through block_table[s]; with a sliding window W > 0
// (Mistral) only to the last W of them, its own included (Hugging Face: key > query - W).
// One work item is (query token, kv head): the group's Hq/Hkv query heads share
// each K/V row read. Softmax is exact (scores kept, then max/exp/sum) in float32.
//
// The inner loops are written so that the compiler vectorises them; on x86-64
// with GCC they are compiled for AVX-512, AVX2 and baseline and picked at load
// time (target_clones), so one build is correct on any x86-64 CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using pds::b2f;

// 16 partial sums: lets the compiler vectorise the reduction without -ffast-math
PDS_CLONES float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

PDS_CLONES float dot_bf16(const float* a, const uint16_t* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b2f(b[i + l]);
  float s = 0;
  for (; i < n; ++i) s += a[i] * b2f(b[i]);
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

PDS_CLONES void axpy_f32(float* y, float w, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

PDS_CLONES void axpy_bf16(float* y, float w, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * b2f(x[i]);
}

inline float dot(const float* a, const float* b, int64_t n) { return dot_f32(a, b, n); }
inline float dot(const float* a, const at::BFloat16* b, int64_t n) {
  return dot_bf16(a, reinterpret_cast<const uint16_t*>(b), n);
}
inline void axpy(float* y, float w, const float* x, int64_t n) { axpy_f32(y, w, x, n); }
inline void axpy(float* y, float w, const at::BFloat16* x, int64_t n) {
  axpy_bf16(y, w, reinterpret_cast<const uint16_t*>(x), n);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& query_start,
         const at::Tensor& context_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_tokens = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = kv.size(2), bs = kv.size(3);
  const int64_t group = hq / hkv, num_seqs = context_lens.size(0), max_pages = block_table.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_row = q.stride(0);  // q may be a row view of the fused qkv projection
  const T* kvp = kv.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  // strides of kv[N, 2, Hkv, B, D] (contiguous)
  const int64_t s_head = bs * d, s_kv = hkv * s_head, s_block = 2 * s_kv;
  // token -> sequence, so work items can be flat over (token, kv head)
  std::vector<int32_t> seq_of(num_tokens);
  int64_t total_keys = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int32_t t = qstart[s]; t < qstart[s + 1]; ++t) {
      seq_of[t] = static_cast<int32_t>(s);
      const int64_t keys = ctx[s] - (qstart[s + 1] - t) + 1;
      total_keys += window > 0 ? std::min<int64_t>(keys, window) : keys;
    }
  // Work items per thread chunk: about 256K K/V values read. A batch-1 decode step reads far fewer,
  // and waking the other OpenMP threads can cost a scheduler time slice on a loaded machine.
  const int64_t values_per_item = std::max<int64_t>(1, 2 * d * total_keys / std::max<int64_t>(num_tokens, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / values_per_item);

  at::parallel_for(0, num_tokens * hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / hkv, h = item % hkv, s = seq_of[t];
      const int64_t q_len = qstart[s + 1] - qstart[s];
      const int64_t end_key = ctx[s] - q_len + (t - qstart[s]) + 1;  // causal: keys 0 .. own position
      const int64_t first = window > 0 ? std::max<int64_t>(0, end_key - window) : 0;
      const int64_t n_keys = end_key - first;
      const int32_t* pages = table + s * max_pages;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(qp[t * q_row + (h * group + g) * d + i]) * static_cast<float>(scale);
      scores.resize(group * n_keys);
      for (int64_t p = 0; p < n_keys; ++p) {
        const int64_t key = first + p;
        const T* krow = kvp + pages[key / bs] * s_block + h * s_head + (key % bs) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * n_keys + p] = dot(&qf[g * d], krow, d);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = &scores[g * n_keys];
        float mx = -INFINITY;
        for (int64_t p = 0; p < n_keys; ++p) mx = sc[p] > mx ? sc[p] : mx;
        float sum = 0;
        for (int64_t p = 0; p < n_keys; ++p) { sc[p] = std::exp(sc[p] - mx); sum += sc[p]; }
        const float inv = 1.0f / sum;
        for (int64_t p = 0; p < n_keys; ++p) sc[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < n_keys; ++p) {
        const int64_t key = first + p;
        const T* vrow = kvp + pages[key / bs] * s_block + s_kv + h * s_head + (key % bs) * d;
        for (int64_t g = 0; g < group; ++g) axpy(&acc[g * d], scores[g * n_keys + p], vrow, d);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) op[(t * hq + h * group + g) * d + i] = static_cast<T>(acc[g * d + i]);
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
