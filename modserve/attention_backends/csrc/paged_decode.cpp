// Decode attention straight from a paged KV cache of float32 or bf16 values, in float32, on
// the CPU.
//
// One task per (sequence, KV head): its G = H / Hkv query heads score every cached key
// of that head block by block, in place (no gather into a padded copy), softmax each
// row over exactly the sequence's length, and sum the values the same way. The torch
// path it replaces gathered keys and values into [B, Hkv, L, D] buffers first, so it
// moved every byte three times; this reads each once.
//
// The kernel is written once over vectors of N floats: N = 16 where the build has AVX-512
// (kWidest; the build is -march=native, so per machine), else 8. Each pass keeps its sums
// in registers: scores take N keys at a time per query row (one shuffle tree sums all N),
// the softmax exponentials are computed N at a time, and the values go into up to 4
// query rows x 16 (N = 8) or 64 (N = 16) dimensions of accumulators. A bf16 key block is
// widened once into float32 scratch when several query rows read it (G >= 2). A
// sequence's blocks lie anywhere in the pool, so the next block is prefetched (into L2)
// while one is read: no hardware prefetcher can guess it. 64 decodes of ~170 tokens read
// their KV at 13.6-15 GB/s on a 2-core Zen 4 VM, where the weights stream at ~30. A bf16
// cache (the CPU's bf16_gemm route) is read the same way, each value widened as it is loaded:
// half the bytes, the same float32 arithmetic.
//
// Registered as torch.ops.modserve_paged.decode, with vector_width() for the build's widest
// (built by modserve/plugins/platforms/cpu/kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "claims.h"  // parallel_claims: modserve/api/csrc/, on every kernel's include path
#include "vec8.h"    // v8, load8, store8, hsum, exp8

namespace {

using modserve::v8;

// A cache value: float32, or bf16 as its raw 16-bit pattern (Lanes<N>::load widens either).
using bf16_bits = uint16_t;

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

// What the kernel needs of a vector of N floats; Lanes<8> is vec8.h's.
template <int N>
struct Lanes;

template <>
struct Lanes<8> {
  using V = v8;
  static constexpr int kMaxW = 2;  // value accumulators: 4 rows x 2 vectors (16 of AVX2's registers)
  static V load(const float* p) { return modserve::load8(p); }
  static V load(const bf16_bits* p) { return modserve::load8(p); }
  static void store(float* p, V v) { modserve::store8(p, v); }
  static V splat(float x) { return V{x, x, x, x, x, x, x, x}; }  // a broadcast (V{} + x would add first)
  static float sum(V v) { return modserve::hsum(v); }
  static V sums(const V* a) { return hsum8(a); }
  static V exp(V x) { return modserve::exp8(x); }
};

#ifdef __AVX512F__
constexpr int kWidest = 16;

using modserve::v16;
typedef int32_t i16 __attribute__((vector_size(64)));

// The sixteen sums of a[0..15], as one vector: four rounds of shuffles and adds, each
// halving the vectors. After round r a vector holds partial sums of 2^r inputs, the input
// in its low r lane bits, the part of the row in the rest.
inline v16 hsum16(const v16* a) {
  v16 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // pairs of a[2i] (even lanes) and a[2i+1] (odd lanes)
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)  // quarters of four inputs
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)  // halves of eight inputs
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(w[0], w[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

template <>
struct Lanes<16> {
  using V = v16;
  static constexpr int kMaxW = 4;  // 4 rows x 4 vectors: a 64-wide head in one pass (of 32 registers)
  static V load(const float* p) {
    V r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  static V load(const bf16_bits* p) { return modserve::load16(p); }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static V splat(float x) { return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
  static float sum(V v) {
    v8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return modserve::hsum(lo + hi);
  }
  static V sums(const V* a) { return hsum16(a); }
  static V exp(V x) { return modserve::exp_lanes<V, i16>(x); }  // exp8's arithmetic, sixteen at a time
};
#else
constexpr int kWidest = 8;
#endif

// out[g] = q[g] . k for the G query rows q (each D long, D a multiple of N): one key.
template <int N, class C>
inline void dots(const float* __restrict q, const C* __restrict k, int64_t G, int64_t D, float* out) {
  using L = Lanes<N>;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    typename L::V a = {}, c = {};
    int64_t d = 0;
    for (; d + 2 * N <= D; d += 2 * N) {
      a += L::load(qg + d) * L::load(k + d);
      c += L::load(qg + d + N) * L::load(k + d + N);
    }
    for (; d < D; d += N) a += L::load(qg + d) * L::load(k + d);
    out[g] = L::sum(a + c);
  }
}

// s * (q . k_j) for the N keys k_0..N-1 (rows D apart) and one query row q, into out[0..N-1].
template <int N, class C>
inline void dots_n(const float* __restrict q, const C* __restrict k, int64_t D, float s, float* out) {
  using L = Lanes<N>;
  typename L::V a[N] = {};
  for (int64_t d = 0; d < D; d += N) {
    const typename L::V qv = L::load(q + d);
    for (int j = 0; j < N; ++j) a[j] += qv * L::load(k + j * D + d);
  }
  L::store(out, L::sums(a) * s);
}

// n floats, a 64-byte line at a time, into L2 (locality 1), not L1: a block is 64 lines,
// more misses than L1 tracks at once, so prefetches into L1 stalled the loads they ran
// ahead of. Into L2, 64 decodes of ~170 tokens over 12 layers took 17-19 ms against 24-27
// (8 decodes: 1.9 against 2.7 ms; one: the same), alternating in one process.
template <class C>
inline void prefetch_block(const C* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(C)) __builtin_prefetch(p + i, 0, 1);
}

// n values of a bf16 cache widened into float32 (n a multiple of N).
template <int N>
inline void widen(const bf16_bits* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; i += N) Lanes<N>::store(dst + i, Lanes<N>::load(src + i));
}

template <int N>
using Acc = typename Lanes<N>::V[4][Lanes<N>::kMaxW];

// acc[g] (W vectors of N) += sum over the block's n keys of p[g][t] * v_t, for GC query
// rows at once: their W * GC accumulators stay in registers while the values stream by.
template <int N, int GC, int W, class C>
inline void weighted_values(const float* __restrict p, int64_t p_stride, const C* __restrict v, int64_t D,
                            int64_t n, Acc<N>& acc) {
  using L = Lanes<N>;
  for (int64_t t = 0; t < n; ++t) {
    typename L::V x[W];
    for (int w = 0; w < W; ++w) x[w] = L::load(v + t * D + N * w);
    for (int g = 0; g < GC; ++g) {
      const typename L::V pg = L::splat(p[g * p_stride + t]);
      for (int w = 0; w < W; ++w) acc[g][w] += pg * x[w];
    }
  }
}

template <int N, int W, class C>
inline void weighted_values(int gc, const float* p, int64_t p_stride, const C* v, int64_t D, int64_t n,
                            Acc<N>& acc) {
  switch (gc) {
    case 1: weighted_values<N, 1, W>(p, p_stride, v, D, n, acc); break;
    case 2: weighted_values<N, 2, W>(p, p_stride, v, D, n, acc); break;
    case 3: weighted_values<N, 3, W>(p, p_stride, v, D, n, acc); break;
    default: weighted_values<N, 4, W>(p, p_stride, v, D, n, acc); break;
  }
}

// The same for W = w vectors of the head (1 <= w <= kMaxW).
template <int N, class C>
inline void weighted_values(int w, int gc, const float* p, int64_t p_stride, const C* v, int64_t D, int64_t n,
                            Acc<N>& acc) {
  if constexpr (Lanes<N>::kMaxW == 2) {
    if (w == 2) weighted_values<N, 2>(gc, p, p_stride, v, D, n, acc);
    else weighted_values<N, 1>(gc, p, p_stride, v, D, n, acc);
  } else {
    switch (w) {
      case 1: weighted_values<N, 1>(gc, p, p_stride, v, D, n, acc); break;
      case 2: weighted_values<N, 2>(gc, p, p_stride, v, D, n, acc); break;
      case 3: weighted_values<N, 3>(gc, p, p_stride, v, D, n, acc); break;
      default: weighted_values<N, 4>(gc, p, p_stride, v, D, n, acc); break;
    }
  }
}
// q [B, H, D]; key_cache, value_cache [num_blocks, Hkv, block_size, D] of C;
// block_tables [B, max_blocks] int64; seq_lens [B] int64 (keys 0..len-1 are attended).
// N floats a vector (8, or 16 where kWidest is; D a multiple of N).
template <int N, class C>
at::Tensor decode_cache(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  using L = Lanes<N>;
  using V = typename L::V;
  constexpr int64_t kPass = N * L::kMaxW;  // head dimensions a value pass accumulates
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = key_cache.size(1), block_size = key_cache.size(2);
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
  // G query rows over several bf16 keys: widen each key once, not once per row
  constexpr bool bf16 = std::is_same_v<C, bf16_bits>;
  const bool widen_keys = bf16 && G >= 2;

  // two (sequence, KV head) tasks a claim: lengths differ, and so may the threads' cores
  modserve::parallel_claims(B * Hkv, 2, [&](int64_t begin, int64_t end) {
    // a thread's scratch outlives its claims (~128 of them a call), so it is allocated once
    thread_local std::vector<float> scores, row_scores, keys;
    row_scores.resize(G);
    if (widen_keys) keys.resize(block_size * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= max_blocks,
                  "modserve_paged.decode: sequence length beyond its block table");
      const float* qb = qp + (b * H + h * G) * D;  // G query rows of this KV head
      float* ob = op + (b * H + h * G) * D;
      scores.resize(G * len);
      // n keys kb (float32 or bf16) from key j0 on: N at a time against each query row (the
      // keys stay in L1 for the next row), a lone key only for a block's tail.
      auto score = [&](const auto* kb, int64_t j0, int64_t n) {
        int64_t t = 0;
        for (; t + N <= n; t += N)
          for (int64_t g = 0; g < G; ++g) dots_n<N>(qb + g * D, kb + t * D, D, s, scores.data() + g * len + j0 + t);
        for (; t < n; ++t) {
          dots<N>(qb, kb + t * D, G, D, row_scores.data());
          for (int64_t g = 0; g < G; ++g) scores[g * len + j0 + t] = s * row_scores[g];
        }
      };
      for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const C* kb = block_at(kp, b, j0 / block_size, h);
        const int64_t n = std::min(block_size, len - j0);
        // The next block (the first value block after the last key block) is elsewhere in
        // memory, where no hardware prefetcher guesses: ask for it one block ahead.
        prefetch_block(j0 + block_size < len ? block_at(kp, b, j0 / block_size + 1, h) : block_at(vp, b, 0, h),
                       block_size * D);
        if constexpr (bf16) {
          if (widen_keys) {
            widen<N>(kb, n * D, keys.data());
            score(static_cast<const float*>(keys.data()), j0, n);
            continue;
          }
        }
        score(kb, j0, n);
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax of each query row, in place
        float* row = scores.data() + g * len;
        V top = L::splat(-std::numeric_limits<float>::infinity());
        int64_t j = 0;
        for (; j + N <= len; j += N) {
          const V x = L::load(row + j);
          top = x > top ? x : top;
        }
        float m = top[0];
        for (int i = 1; i < N; ++i) m = std::max(m, top[i]);
        for (; j < len; ++j) m = std::max(m, row[j]);
        V sums = {};
        float total = 0.f;
        for (j = 0; j + N <= len; j += N) {
          const V e = L::exp(L::load(row + j) - m);
          L::store(row + j, e);
          sums += e;
        }
        for (; j < len; ++j) total += (row[j] = std::exp(row[j] - m));
        const float inv = 1.f / (total + L::sum(sums));
        for (j = 0; j < len; ++j) row[j] *= inv;
      }
      // Values: up to 4 query rows by kPass dimensions of accumulators per pass over the
      // sequence's value rows (the later passes find them in cache).
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int gc = static_cast<int>(std::min<int64_t>(4, G - g0));
        for (int64_t d0 = 0; d0 < D; d0 += kPass) {
          const int w = static_cast<int>(std::min<int64_t>(kPass, D - d0) / N);
          Acc<N> acc = {};
          for (int64_t j0 = 0; j0 < len; j0 += block_size) {
            const C* vb = block_at(vp, b, j0 / block_size, h) + d0;
            const int64_t n = std::min(block_size, len - j0);
            if (d0 == 0 && j0 + block_size < len) prefetch_block(block_at(vp, b, j0 / block_size + 1, h), block_size * D);
            if (d0 + kPass >= D && j0 == 0 && task + 1 < end)  // the next task's first key block
              prefetch_block(block_at(kp, (task + 1) / Hkv, 0, (task + 1) % Hkv), block_size * D);
            weighted_values<N>(w, gc, scores.data() + g0 * len + j0, len, vb, D, n, acc);
          }
          for (int g = 0; g < gc; ++g)
            for (int i = 0; i < w; ++i) L::store(ob + (g0 + g) * D + d0 + N * i, acc[g][i]);
        }
      }
    }
  });
  return out;
}

// Lanes a vector of the build's widest kind holds: 16 with AVX-512, else 8.
int64_t vector_width() { return kWidest; }

// q [B, H, D] float32; key_cache, value_cache [num_blocks, Hkv, block_size, D], both float32
// or both bf16; block_tables [B, max_blocks] int64; seq_lens [B] int64 -> [B, H, D] float32.
// width: the most floats a vector holds, 8 or 16 (0: the build's widest); 16 needs D a
// multiple of 16, else the 8-float path runs.
at::Tensor decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t width) {
  TORCH_CHECK(q.device().is_cpu(), "modserve_paged.decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "modserve_paged.decode: q [B, H, D], caches [blocks, Hkv, block_size, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "modserve_paged.decode: contiguous caches");
  const int64_t H = q.size(1), D = q.size(2), Hkv = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == D && H % Hkv == 0 && D % 8 == 0, "modserve_paged.decode: head shapes disagree "
              "(or head_dim is not a multiple of 8)");
  TORCH_CHECK(width == 0 || width == 8 || width == kWidest, "modserve_paged.decode: width ", width,
              ": 0 (the widest), 8, or 16 in a build with AVX-512 (this build's widest: ", kWidest, ")");
  const auto cache = key_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (cache == at::kFloat || cache == at::kBFloat16) &&
                  value_cache.scalar_type() == cache,
              "modserve_paged.decode: float32 queries, a float32 or bfloat16 cache");
#ifdef __AVX512F__
  if (width != 8 && D % 16 == 0)
    return cache == at::kFloat ? decode_cache<16, float>(q, key_cache, value_cache, block_tables, seq_lens, scale)
                               : decode_cache<16, bf16_bits>(q, key_cache, value_cache, block_tables, seq_lens, scale);
#endif
  return cache == at::kFloat ? decode_cache<8, float>(q, key_cache, value_cache, block_tables, seq_lens, scale)
                             : decode_cache<8, bf16_bits>(q, key_cache, value_cache, block_tables, seq_lens, scale);
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
  return decode(q, kv_cache.select(0, 0), kv_cache.select(0, 1), block_tables, seq_lens, scale, 0);
}

}  // namespace

TORCH_LIBRARY(modserve_paged, m) {
  m.def("decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int width=0) -> Tensor");
  m.def("decode_step(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
  m.def("vector_width() -> int", &vector_width);  // no tensors: every dispatch key
  m.impl("decode_step", c10::DispatchKey::CPU, TORCH_FN(decode_step));
}
