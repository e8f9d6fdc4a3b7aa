// y = (x @ q.T) * s (+ b) for a few float32 rows x against int8 weights q [N, K] with one
// float32 scale per output row s [N], on the CPU: the int8 quantizer's decode path.
//
// With a handful of rows a linear layer is bound by reading its weights, and int8 ones are
// a quarter of float32's bytes and half of bfloat16's. Each weight row is read once for up
// to 8 rows of x (9-16 rows take two passes), widened to float32 in registers and
// multiplied in float32; the row's scale multiplies the finished sum, as the dequantizing
// path's scaled output does. A few weight rows are read side by side, the next few
// prefetched. Threads claim output rows in pieces (row_passes.h).
//
// More rows than kMaxRows (prefill, large batches): the same passes of 8 rows, each over a
// block of weight rows small enough to stay in L2 while every pass reads it, so q is read
// from memory once and never widened to a float32 copy. In C++ so that one op serves every
// row count: a compiled region traces no branch on the rows.
//
// Beyond kMaxRows rows with bf16 activations (linear_bf16, below): the int8 weights widened
// to bf16 and multiplied on the AMX tiles.
//
// Registered as torch.ops.modserve_int8.linear (built by modserve/quantizers/int8.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "row_passes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

// The widening of int8 to float32, one path per instruction set, all compiled where the
// build's instructions allow (the widest runs; modserve_int8::linear_path names one, for
// the tests). GCC turns the generic widening of int8 vectors into scalar code (an AVX2 form
// of this kernel ran 4x slower with it), hence the intrinsics. `regs`: vector registers,
// which bound how many accumulators a pass keeps.
#if defined(__AVX512F__)
struct Avx512 {  // one vpmovsxbd, one vcvtdq2ps and one FMA per row of x per 16 weights
  static constexpr int64_t lanes = 16, regs = 32;
  typedef float vf __attribute__((vector_size(64)));
  static vf widen(const int8_t* p) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
  static float hsum(vf v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
};
#endif
#if defined(__AVX2__)
struct Avx2 {
  static constexpr int64_t lanes = 8, regs = 16;
  typedef float vf __attribute__((vector_size(32)));
  static vf widen(const int8_t* p) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
  static float hsum(vf v) {
    const vf a = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    const vf b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    return b[0] + b[1];
  }
};
#endif
struct Generic {  // any compiler and CPU: what the vector extensions make of it
  static constexpr int64_t lanes = 8, regs = 16;
  typedef float vf __attribute__((vector_size(32)));
  typedef int8_t i8x8 __attribute__((vector_size(8)));
  static vf widen(const int8_t* p) {
    i8x8 q;
    std::memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, vf);
  }
  static float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
  }
};

template <class vf>
inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

constexpr int64_t kPassRows = 8;  // rows one pass over q takes: their accumulators stay in registers
constexpr int64_t kMaxRows = 16;  // beyond two passes, q in blocks that stay in cache (many_rows)
constexpr int64_t kLine = 64;     // bytes of a cache line: the unit of the inner loop and its prefetch
// How far ahead in each weight row a line is prefetched, into L1: 1 KiB read faster than
// 512 B, 2 KiB, 4 KiB, or the same line of the next G rows (G whole rows ahead, up to 64 KiB
// in flight: more than L1 holds).
constexpr int64_t kAhead = 1024;

// Weight rows a pass reads side by side: as many as the M x G accumulators and G widened
// vectors leave registers for, at most 8. One row at a time held one FMA chain per row of
// x, and a single core then read at about half of what it streams with several rows: the
// chains' latency, not memory, set the pace. Side by side, G rows also make G streams for
// the prefetchers.
template <class V, int64_t M>
constexpr int64_t side_by_side() {
  int64_t g = 8;
  while (g > 1 && M * g + g + 2 > V::regs) g /= 2;
  return g;
}

// y[m, n] = (sum_k x[m, k] q[n, k]) * s[n] + b[n] for output features [n_begin, n_end), G
// weight rows at a time. Each output has one accumulator, summed over K in order of the
// vector width and reduced at the end, then scaled: the G rows change no sum's order. Each
// row's line kAhead bytes on is prefetched as a line is read (past a row's end: the next G
// rows', possibly another thread's): a row of a few KiB is too short a stream for the
// hardware prefetcher to ramp up.
template <class V, int64_t M, int64_t G = side_by_side<V, M>()>
void rows_times_int8(const float* x, const int8_t* q, const float* scale, const float* bias, float* y, int64_t K,
                     int64_t N, int64_t n_begin, int64_t n_end) {
  typedef typename V::vf vf;
  constexpr int64_t L = V::lanes, U = kLine / L;  // vectors per cache line of a weight row
  int64_t n = n_begin;
  for (; n + G <= n_end; n += G) {
    const int8_t* qn = q + n * K;
    vf acc[M][G] = {};
    int64_t k = 0;
    for (; k + kLine <= K; k += kLine) {
      const int64_t ahead = k + kAhead < K ? k + kAhead : k + kAhead + (G - 1) * K;  // from qn
      if ((n + G - 1) * K + ahead < N * K) {  // never past the end of q
        for (int64_t g = 0; g < G; ++g) __builtin_prefetch(qn + g * K + ahead, 0, 3);
      }
      for (int64_t u = 0; u < U; ++u) {
        vf w[G];
        for (int64_t g = 0; g < G; ++g) w[g] = V::widen(qn + g * K + k + L * u);
        for (int64_t m = 0; m < M; ++m) {
          const vf xv = load<vf>(x + m * K + k + L * u);
          for (int64_t g = 0; g < G; ++g) acc[m][g] += xv * w[g];
        }
      }
    }
    for (; k + L <= K; k += L) {  // K % 64: whole vectors
      for (int64_t g = 0; g < G; ++g) {
        const vf w = V::widen(qn + g * K + k);
        for (int64_t m = 0; m < M; ++m) acc[m][g] += load<vf>(x + m * K + k) * w;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        float dot = V::hsum(acc[m][g]);
        for (int64_t j = k; j < K; ++j) dot += x[m * K + j] * static_cast<float>(qn[g * K + j]);  // K % lanes
        y[m * N + n + g] = dot * scale[n + g] + (bias ? bias[n + g] : 0.f);
      }
    }
  }
  if constexpr (G > 1) {  // the last rows of the range, one at a time
    if (n < n_end) rows_times_int8<V, M, 1>(x, q, scale, bias, y, K, N, n, n_end);
  }
}

// The compiled paths, widest first: linear() runs the first.
const std::vector<std::string>& paths() {
  static const std::vector<std::string> names = {
#if defined(__AVX512F__)
      "avx512",
#endif
#if defined(__AVX2__)
      "avx2",
#endif
      "generic"};
  return names;
}

template <class V>
void few_rows(const float* x, const int8_t* q, const float* s, const float* b, float* y, int64_t M, int64_t K,
              int64_t N) {
  modserve::for_row_passes(M, N, kPassRows, [&](int64_t r, int64_t rows, int64_t begin, int64_t end) {
    modserve::with_rows(rows, [&](auto m) {
      constexpr int64_t R = decltype(m)::value;
      rows_times_int8<V, R>(x + r * K, q, s, b, y + r * N, K, N, begin, end);
    });
  });
}

// Bytes of q a thread claims at a time beyond kMaxRows rows: with a pass's 8 rows of x
// (8 x K floats), well inside a core's L2, so every pass after the first reads the block
// from there.
constexpr int64_t kBlockBytes = 256 * 1024;

template <class V>
void many_rows(const float* x, const int8_t* q, const float* s, const float* b, float* y, int64_t M, int64_t K,
               int64_t N) {
  const int64_t block = std::max<int64_t>(8, kBlockBytes / std::max<int64_t>(K, 1) / 8 * 8);
  modserve::parallel_claims(N, block, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < M; r += kPassRows) {
      modserve::with_rows(std::min(kPassRows, M - r), [&](auto m) {
        constexpr int64_t R = decltype(m)::value;
        rows_times_int8<V, R>(x + r * K, q, s, b, y + r * N, K, N, begin, end);
      });
    }
  });
}

template <class V>
void any_rows(const float* x, const int8_t* q, const float* s, const float* b, float* y, int64_t M, int64_t K,
              int64_t N) {
  if (M > kMaxRows) many_rows<V>(x, q, s, b, y, M, K, N);
  else few_rows<V>(x, q, s, b, y, M, K, N);
}

at::Tensor linear_with(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const std::string& path) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "modserve_int8.linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat,
              "modserve_int8.linear: float32 x, int8 qweight, float32 scales");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1) &&
                  scales.numel() == qweight.size(0),
              "modserve_int8.linear: x [M, K], qweight [N, K], scales [N]");
  const auto& names = paths();
  TORCH_CHECK(std::find(names.begin(), names.end(), path) != names.end(), "modserve_int8.linear: no path '", path,
              "' in this build (", c10::Join(", ", names), ")");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const at::Tensor xc = x.contiguous(), qc = qweight.contiguous(), sc = scales.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#if defined(__AVX512F__)
  if (path == "avx512") any_rows<Avx512>(xp, qp, sp, bp, yp, M, K, N);
#endif
#if defined(__AVX2__)
  if (path == "avx2") any_rows<Avx2>(xp, qp, sp, bp, yp, M, K, N);
#endif
  if (path == "generic") any_rows<Generic>(xp, qp, sp, bp, yp, M, K, N);
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias) {
  return linear_with(x, qweight, scales, bias, paths().front());
}

// W8A8 (Int8Options.activations: int8): beyond kMaxRows rows, where a step computes rather
// than reads, each row of x is quantized to int8 with its own scale (absmax / 127, vLLM's
// dynamic per-token scheme) and multiplied int8 by int8 into int32 sums (at::_int_mm: oneDNN,
// on VNNI or AMX-INT8 where the CPU has them), scaled by both scales. Up to kMaxRows rows
// (decode, bound by reading q) x stays float32, as in linear().
at::Tensor linear_dynamic(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
  if (x.size(0) <= kMaxRows) return linear(x, qweight, scales, bias);
  TORCH_CHECK(x.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar && x.size(1) == qweight.size(1),
              "modserve_int8.linear_dynamic: float32 x [M, K], int8 qweight [N, K]");
  const at::Tensor x_scale = x.abs().amax(1, true).clamp_min(1e-30f).div_(127.f);  // [M, 1]
  const at::Tensor xq = x.div(x_scale).round_().clamp_(-127, 127).to(at::kChar);   // [M, K]
  at::Tensor y = at::_int_mm(xq, qweight.t()).to(at::kFloat).mul_(x_scale).mul_(scales);  // [M, N]
  return bias.has_value() ? y.add_(*bias) : y;
}

// W8A16 on AMX tiles (Int8Options.activations: bf16). Beyond kMaxRows rows a step computes
// rather than reads, and the tiles multiply bf16 pairs into float32 sums many times faster
// than linear()'s widen-and-FMA passes. Every int8 weight is exact in bf16, so only x is
// rounded (to bf16, as the bf16_gemm route rounds a bf16 checkpoint's activations); the sums
// stay float32 and the scale multiplies them, as in linear().
//
// The weights are the A operand: a block of kWeightRows rows, widened once per pass into a
// per-thread buffer and multiplied by every token of the pass. x^T is the B operand, packed
// once per call into oneDNN's VNNI layout by blocks of kTokens tokens (the last one padded
// with zeros). So no int8 weight is ever transposed; C [weight rows, tokens] is small and is
// written back transposed, scaled. The GEMM is torch's cpublas::brgemm: oneDNN's ukernel.
constexpr int64_t kWeightRows = 64;  // rows of q per A block: four tiles of 16 rows
// Tokens of one packed B block: 64 (torch's flash attention packs 64 too), or 32 for a step
// of up to 32 rows, which pads fewer tokens with zeros.
constexpr int64_t kTokens = 64;
constexpr int64_t kPassTokens = 256;  // tokens one pass over the weights multiplies: x's share stays in L2
constexpr int64_t kChunk = 256;  // K per brgemm call where K is a multiple: 32 KiB of A and of B, near L1

// n int8 weights -> bf16: exact, so the bf16 is the top half of the float32.
void widen_bf16(const int8_t* q, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i f = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(f, 16)));
  }
#endif
  for (; i < n; ++i) {
    const float f = static_cast<float>(q[i]);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

bool bf16_tiles() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  namespace cpublas = at::native::cpublas;
  // An odd K (no layer of a real model: the tiles take K in pairs) keeps linear()'s float32 x.
  if (x.size(0) <= kMaxRows || x.size(1) % 2 != 0) return linear(x, qweight, scales, bias);
  TORCH_CHECK(bf16_tiles(), "modserve_int8.linear_bf16: this CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar && x.dim() == 2 &&
                  x.size(1) == qweight.size(1),
              "modserve_int8.linear_bf16: float32 x [M, K], int8 qweight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t tokens = M <= kTokens / 2 ? kTokens / 2 : kTokens;
  const int64_t blocks = (M + tokens - 1) / tokens, padded = blocks * tokens;
  at::Tensor xt = at::zeros({K, padded}, x.options().dtype(at::kBFloat16));  // [K, padded]: x^T, rounded
  xt.narrow(1, 0, M).copy_(x.t());
  at::Tensor packed = at::empty({blocks, K * tokens}, xt.options());  // [blocks, K * tokens] VNNI
  const auto* xtp = xt.data_ptr<at::BFloat16>();
  auto* bp = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      cpublas::pack(K, tokens, padded, tokens, at::kBFloat16, at::kBFloat16, xtp + b * tokens, bp + b * K * tokens);
  });
  const at::Tensor qc = qweight.contiguous(), sc = scales.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* biasp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // A in chunks of K, each row padded by a cache line: rows 2^n bytes apart alias in L1.
  const int64_t chunk = K % kChunk == 0 ? kChunk : K, chunks = K / chunk, lda = chunk + 32;
  const int64_t weight_blocks = (N + kWeightRows - 1) / kWeightRows, per_pass = kPassTokens / tokens;
  for (int64_t first = 0; first < blocks; first += per_pass) {
    const int64_t last = std::min(blocks, first + per_pass);
    at::parallel_for(0, weight_blocks, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<at::BFloat16[]> a(new at::BFloat16[chunks * kWeightRows * lda]);  // [chunks, rows, lda]
      std::unique_ptr<float[]> c(new float[kWeightRows * tokens]);                     // [rows, tokens]
      for (int64_t wb = begin; wb < end; ++wb) {
        const int64_t n0 = wb * kWeightRows, rows = std::min(kWeightRows, N - n0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t h = 0; h < chunks; ++h) {
            widen_bf16(qp + (n0 + r) * K + h * chunk, reinterpret_cast<uint16_t*>(a.get() + (h * kWeightRows + r) * lda),
                       chunk);
          }
        }
        for (int64_t b = first; b < last; ++b) {
          for (int64_t h = 0; h < chunks; ++h) {
            cpublas::brgemm(rows, tokens, chunk, lda, tokens, tokens, /*add_C=*/h > 0,
                            a.get() + h * kWeightRows * lda, bp + b * K * tokens + h * chunk * tokens, c.get());
          }
          for (int64_t m = b * tokens; m < std::min(M, (b + 1) * tokens); ++m) {
            float* ym = yp + m * N + n0;
            const float* cm = c.get() + (m - b * tokens);
            for (int64_t r = 0; r < rows; ++r) ym[r] = cm[r * tokens] * sp[n0 + r] + (biasp ? biasp[n0 + r] : 0.f);
          }
        }
      }
      cpublas::brgemm_release();
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(modserve_int8, m) {
  m.def("linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("linear_dynamic(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("linear_dynamic", c10::DispatchKey::CPU, TORCH_FN(linear_dynamic));
  m.def("linear_bf16(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, TORCH_FN(linear_bf16));
  m.def("bf16_tiles() -> bool", [] { return bf16_tiles(); });
  // The same product by a named path of this build, and the paths: for tests and benchmarks.
  m.def("linear_path(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, str path) -> Tensor");
  m.impl("linear_path", c10::DispatchKey::CPU, TORCH_FN(linear_with));
  m.def("paths() -> str[]", [] { return paths(); });
}
