// Decode attention straight from a paged KV cache, float32, on the CPU.
//
// One task per (sequence, KV head): its G = H / Hkv query heads score every cached key
// of that head block by block, in place (no gather into a padded copy), softmax each
// row over exactly the sequence's length, and sum the values the same way. The torch
// path it replaces gathered keys and values into [B, Hkv, L, D] buffers first, so it
// moved every byte three times; this reads each once.
//
// Registered as torch.ops.modserve_paged.decode (built by modserve/core/cpu_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Eight floats, one AVX register where the build has them (GCC/Clang vector extension).
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline float hsum(v8 v) {  // a tree, not a chain of seven dependent adds
  const v8 a = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8 b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}

// out[g] = q[g] . k for the G query rows q (each D long, D a multiple of 8).
inline void dots(const float* __restrict q, const float* __restrict k, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    v8 a = {}, c = {};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      a += load8(qg + d) * load8(k + d);
      c += load8(qg + d + 8) * load8(k + d + 8);
    }
    for (; d < D; d += 8) a += load8(qg + d) * load8(k + d);
    out[g] = hsum(a + c);
  }
}

// y += a * x, D long (a multiple of 8).
inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t D) {
  const v8 av = {a, a, a, a, a, a, a, a};
  for (int64_t d = 0; d < D; d += 8) {
    v8 r = load8(y + d) + av * load8(x + d);
    std::memcpy(y + d, &r, sizeof r);
  }
}

// q [B, H, D]; key_cache, value_cache [num_blocks, Hkv, block_size, D];
// block_tables [B, max_blocks] int64; seq_lens [B] int64 (keys 0..len-1 are attended).
at::Tensor decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "modserve_paged.decode: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "modserve_paged.decode: float32 queries and cache only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "modserve_paged.decode: q [B, H, D], caches [blocks, Hkv, block_size, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "modserve_paged.decode: contiguous caches");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % Hkv == 0 && D % 8 == 0, "modserve_paged.decode: head shapes disagree "
              "(or head_dim is not a multiple of 8)");
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "modserve_paged.decode: one table and length per query");
  const int64_t G = H / Hkv, max_blocks = tables.size(1);
  at::Tensor out = at::empty_like(qc);

  const float* qp = qc.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D), row_scores(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= max_blocks,
                  "modserve_paged.decode: sequence length beyond its block table");
      const float* qb = qp + (b * H + h * G) * D;  // G query rows of this KV head
      scores.resize(G * len);
      for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const int64_t block = tp[b * max_blocks + j0 / block_size];
        const float* kb = kp + (block * Hkv + h) * block_size * D;
        const int64_t n = std::min(block_size, len - j0);
        for (int64_t t = 0; t < n; ++t) {
          dots(qb, kb + t * D, G, D, row_scores.data());
          for (int64_t g = 0; g < G; ++g) scores[g * len + j0 + t] = s * row_scores[g];
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax of each query row, in place
        float* row = scores.data() + g * len;
        const float m = *std::max_element(row, row + len);
        float total = 0.f;
        for (int64_t j = 0; j < len; ++j) total += (row[j] = std::exp(row[j] - m));
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; ++j) row[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const int64_t block = tp[b * max_blocks + j0 / block_size];
        const float* vb = vp + (block * Hkv + h) * block_size * D;
        const int64_t n = std::min(block_size, len - j0);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, scores[g * len + j0 + t], vb + t * D, D);
      }
      std::copy(acc.begin(), acc.end(), op + (b * H + h * G) * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(modserve_paged, m) {
  m.def("decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
}
