// Decode attention straight from a paged KV cache of float32 or bf16 values, in float32, on
// the CPU.
//
// One task per (sequence, KV head): its G = H / Hkv query heads score every cached key
// of that head block by block, in place (no gather into a padded copy), softmax each
// row over exactly the sequence's length, and sum the values the same way. The torch
// path it replaces gathered keys and values into [B, Hkv, L, D] buffers first, so it
// moved every byte three times; this reads each once.
//
// Each pass keeps its sums in registers: scores take eight keys at a time per query row
// (one shuffle tree sums all eight), the softmax exponentials are computed eight at a
// time, and the values go into up to 4 query rows x 16 dimensions of accumulators. A
// sequence's blocks lie anywhere in the pool, so the next block is prefetched (into L2)
// while one is read: no hardware prefetcher can guess it. 64 decodes of ~170 tokens read
// their KV at 13.6-15 GB/s on a 2-core Zen 4 VM, where the weights stream at ~30. A bf16
// cache (the CPU's bf16_gemm route) is read the same way, each value widened as it is loaded:
// half the bytes, the same float32 arithmetic.
//
// Registered as torch.ops.modserve_paged.decode (built by modserve/plugins/platforms/cpu/kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "claims.h"  // parallel_claims: modserve/api/csrc/, on every kernel's include path
#include "vec8.h"    // v8, load8, store8, hsum, exp8

namespace {

using modserve::exp8;
using modserve::hsum;
using modserve::i8;
using modserve::load8;
using modserve::store8;
using modserve::v8;

// A cache value: float32, or bf16 as its raw 16-bit pattern (load8 widens either).
using bf16_bits = uint16_t;

// out[g] = q[g] . k for the G query rows q (each D long, D a multiple of 8): one key.
template <class C>
inline void dots(const float* __restrict q, const C* __restrict k, int64_t G, int64_t D, float* out) {
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

// The eight sums of a[0..7], as one vector: three rounds of pairwise shuffles and adds
// (21 operations) instead of eight separate horizontal sums.
inline v8 hsum8(const v8* a) {
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // t[i] = sums of adjacent pairs of a[2i] and a[2i+1], interleaved
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)  // quarter sums of four vectors, low lane then high lane
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// s * (q . k_j) for the eight keys k_0..7 (rows D apart) and one query row q, into out[0..7].
template <class C>
inline void dots8(const float* __restrict q, const C* __restrict k, int64_t D, float s, float* out) {
  v8 a[8] = {};
  for (int64_t d = 0; d < D; d += 8) {
    const v8 qv = load8(q + d);
    for (int j = 0; j < 8; ++j) a[j] += qv * load8(k + j * D + d);
  }
  store8(out, hsum8(a) * s);
}

// n floats, a 64-byte line at a time, into L2 (locality 1), not L1: a block is 64 lines,
// more misses than L1 tracks at once, so prefetches into L1 stalled the loads they ran
// ahead of. Into L2, 64 decodes of ~170 tokens over 12 layers took 17-19 ms against 24-27
// (8 decodes: 1.9 against 2.7 ms; one: the same), alternating in one process.
template <class C>
inline void prefetch_block(const C* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(C)) __builtin_prefetch(p + i, 0, 1);
}

// acc[g] (W vectors of 8) += sum over the block's n keys of p[g][t] * v_t, for GC query
// rows at once: their 2 * GC accumulators stay in registers while the values stream by.
template <int GC, int W, class C>
inline void weighted_values(const float* __restrict p, int64_t p_stride, const C* __restrict v, int64_t D,
                            int64_t n, v8 (&acc)[4][2]) {
  for (int64_t t = 0; t < n; ++t) {
    v8 x[W];
    for (int w = 0; w < W; ++w) x[w] = load8(v + t * D + 8 * w);
    for (int g = 0; g < GC; ++g) {
      const float pt = p[g * p_stride + t];
      const v8 pg = {pt, pt, pt, pt, pt, pt, pt, pt};  // a broadcast (v8{} + pt would add first)
      for (int w = 0; w < W; ++w) acc[g][w] += pg * x[w];
    }
  }
}

template <int W, class C>
inline void weighted_values(int gc, const float* p, int64_t p_stride, const C* v, int64_t D, int64_t n,
                            v8 (&acc)[4][2]) {
  switch (gc) {
    case 1: weighted_values<1, W>(p, p_stride, v, D, n, acc); break;
    case 2: weighted_values<2, W>(p, p_stride, v, D, n, acc); break;
    case 3: weighted_values<3, W>(p, p_stride, v, D, n, acc); break;
    default: weighted_values<4, W>(p, p_stride, v, D, n, acc); break;
  }
}

// q [B, H, D]; key_cache, value_cache [num_blocks, Hkv, block_size, D] of C;
// block_tables [B, max_blocks] int64; seq_lens [B] int64 (keys 0..len-1 are attended).
template <class C>
at::Tensor decode_cache(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
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
  const C* kp = static_cast<const C*>(key_cache.data_ptr());
  const C* vp = static_cast<const C*>(value_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // Where sequence b's block number i (of its table) holds KV head h, in a cache half.
  auto block_at = [&](const C* cache, int64_t b, int64_t i, int64_t h) {
    return cache + (tp[b * max_blocks + i] * Hkv + h) * block_size * D;
  };

  // two (sequence, KV head) tasks a claim: lengths differ, and so may the threads' cores
  modserve::parallel_claims(B * Hkv, 2, [&](int64_t begin, int64_t end) {
    // a thread's scratch outlives its claims (~128 of them a call), so it is allocated once
    thread_local std::vector<float> scores, row_scores;
    row_scores.resize(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= max_blocks,
                  "modserve_paged.decode: sequence length beyond its block table");
      const float* qb = qp + (b * H + h * G) * D;  // G query rows of this KV head
      float* ob = op + (b * H + h * G) * D;
      scores.resize(G * len);
      // Scores: eight keys at a time against each query row (the keys stay in L1 for the
      // next row), a lone key only for a block's tail.
      for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const C* kb = block_at(kp, b, j0 / block_size, h);
        const int64_t n = std::min(block_size, len - j0);
        // The next block (the first value block after the last key block) is elsewhere in
        // memory, where no hardware prefetcher guesses: ask for it one block ahead.
        prefetch_block(j0 + block_size < len ? block_at(kp, b, j0 / block_size + 1, h) : block_at(vp, b, 0, h),
                       block_size * D);
        int64_t t = 0;
        for (; t + 8 <= n; t += 8)
          for (int64_t g = 0; g < G; ++g) dots8(qb + g * D, kb + t * D, D, s, scores.data() + g * len + j0 + t);
        for (; t < n; ++t) {
          dots(qb, kb + t * D, G, D, row_scores.data());
          for (int64_t g = 0; g < G; ++g) scores[g * len + j0 + t] = s * row_scores[g];
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax of each query row, in place
        float* row = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) m = std::max(m, row[j]);
        v8 sums = {};
        float total = 0.f;
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) {
          const v8 e = exp8(load8(row + j) - m);
          store8(row + j, e);
          sums += e;
        }
        for (; j < len; ++j) total += (row[j] = std::exp(row[j] - m));
        const float inv = 1.f / (total + hsum(sums));
        for (j = 0; j < len; ++j) row[j] *= inv;
      }
      // Values: up to 4 query rows by 16 dimensions of accumulators per pass over the
      // sequence's value rows (the later passes find them in cache).
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int gc = static_cast<int>(std::min<int64_t>(4, G - g0));
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const int w = D - d0 >= 16 ? 2 : 1;
          v8 acc[4][2] = {};
          for (int64_t j0 = 0; j0 < len; j0 += block_size) {
            const C* vb = block_at(vp, b, j0 / block_size, h) + d0;
            const int64_t n = std::min(block_size, len - j0);
            if (d0 == 0 && j0 + block_size < len) prefetch_block(block_at(vp, b, j0 / block_size + 1, h), block_size * D);
            if (d0 + 16 >= D && j0 == 0 && task + 1 < end)  // the next task's first key block
              prefetch_block(block_at(kp, (task + 1) / Hkv, 0, (task + 1) % Hkv), block_size * D);
            const float* p = scores.data() + g0 * len + j0;
            if (w == 2) weighted_values<2>(gc, p, len, vb, D, n, acc);
            else weighted_values<1>(gc, p, len, vb, D, n, acc);
          }
          for (int g = 0; g < gc; ++g)
            for (int i = 0; i < w; ++i) store8(ob + (g0 + g) * D + d0 + 8 * i, acc[g][i]);
        }
      }
    }
  });
  return out;
}

// q [B, H, D] float32; key_cache, value_cache [num_blocks, Hkv, block_size, D], both float32
// or both bf16; block_tables [B, max_blocks] int64; seq_lens [B] int64 -> [B, H, D] float32.
at::Tensor decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "modserve_paged.decode: CPU tensors only");
  const auto cache = key_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (cache == at::kFloat || cache == at::kBFloat16) &&
                  value_cache.scalar_type() == cache,
              "modserve_paged.decode: float32 queries, a float32 or bfloat16 cache");
  return cache == at::kFloat ? decode_cache<float>(q, key_cache, value_cache, block_tables, seq_lens, scale)
                             : decode_cache<bf16_bits>(q, key_cache, value_cache, block_tables, seq_lens, scale);
}

// Row `row` of a cache half: n values of x, stored as the cache holds them.
inline void store_row(float* cache, int64_t row, const float* x, int64_t n) {
  std::memcpy(cache + row * n, x, n * sizeof(float));
}
inline void store_row(bf16_bits* cache, int64_t row, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) cache[row * n + i] = modserve::to_bf16(x[i]);
}

template <class C>
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache, const int64_t* sp) {
  const int64_t T = k.size(0), Hkv = kv_cache.size(2), block_size = kv_cache.size(3), D = kv_cache.size(4);
  C* key_cache = static_cast<C*>(kv_cache.data_ptr());
  C* value_cache = key_cache + kv_cache.stride(0);
  const int64_t slot_count = kv_cache.size(1) * block_size;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slot_count, "modserve_paged.decode_step: slot beyond the cache");
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t row = ((slot / block_size) * Hkv + h) * block_size + slot % block_size;
      store_row(key_cache, row, kp + (t * Hkv + h) * D, D);
      store_row(value_cache, row, vp + (t * Hkv + h) * D, D);
    }
  }
}

// The backend's forward for a step of T decodes in sequence order, as one op (what a native
// decode step calls): write k, v [T, Hkv, D] at slot_mapping [T] (-1: nowhere) into
// kv_cache [2, num_blocks, Hkv, block_size, D], then decode() over it.
at::Tensor decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       double scale) {
  const auto cache = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (cache == at::kFloat || cache == at::kBFloat16) && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "modserve_paged.decode_step: float32 k, v and a float32 or bfloat16 cache [2, blocks, Hkv, "
              "block_size, D]");
  const int64_t T = k.size(0), Hkv = kv_cache.size(2), D = kv_cache.size(4);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == Hkv && k.size(2) == D && slot_mapping.size(0) == T,
              "modserve_paged.decode_step: k, v [T, Hkv, D] and one slot per row");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  if (cache == at::kFloat) write_kv<float>(kc, vc, kv_cache, slots.data_ptr<int64_t>());
  else write_kv<bf16_bits>(kc, vc, kv_cache, slots.data_ptr<int64_t>());
  return decode(q, kv_cache.select(0, 0), kv_cache.select(0, 1), block_tables, seq_lens, scale);
}

}  // namespace

TORCH_LIBRARY(modserve_paged, m) {
  m.def("decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def("decode_step(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
  m.impl("decode_step", c10::DispatchKey::CPU, TORCH_FN(decode_step));
}
