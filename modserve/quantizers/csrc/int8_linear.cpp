// y = (x @ q.T) * s (+ b) for a few float32 rows x against int8 weights q [N, K] with one
// float32 scale per output row s [N], on the CPU: the int8 quantizer's decode path.
//
// With a handful of rows a linear layer is bound by reading its weights, and int8 ones are
// a quarter of float32's bytes and half of bfloat16's. Each weight row is read once for up
// to 8 rows of x (9-16 rows take two passes), widened to float32 in registers and
// multiplied in float32; the row's scale multiplies the finished sum, as the dequantizing
// path's scaled output does. Threads claim output rows in pieces (row_passes.h).
//
// More rows than kMaxRows: q widened to float32 and a float32 GEMM, the output scaled. In
// C++ so that one op serves every row count: a compiled region traces no branch on the rows.
//
// Registered as torch.ops.modserve_int8.linear (built by modserve/quantizers/int8.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "row_passes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// Sixteen lanes where the CPU has AVX-512 (one vpmovsxbd, one vcvtdq2ps and one FMA per
// 16 weights), else eight with AVX2. GCC turns the generic widening of int8 vectors into
// scalar code (the AVX2 form of this kernel ran 4x slower with it), hence the intrinsics.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
inline vf load_int8(const int8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
}
inline float hsum(vf v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
inline vf load_int8(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
}
inline float hsum(vf v) {
  const vf a = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const vf b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}
#else
constexpr int64_t kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
inline vf load_int8(const int8_t* p) {
  i8x8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, vf);
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
#endif

inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

constexpr int64_t kPassRows = 8;  // rows one pass over q takes: their accumulators stay in registers
constexpr int64_t kMaxRows = 16;  // beyond two passes, widening q for a float32 GEMM is faster
constexpr int64_t kAhead = 4;     // the weight row this many rows on is prefetched (rows are short in bytes)

// U accumulators per row of x split K, so the FMAs of one output do not wait on each other.
// Here one (kAccumulators) was fastest at 1, 2 and 4 rows and no slower at 8: the 48
// linears of the reference model at one row took 2.8-3.1 ms against 3.2-3.7 with four,
// alternating in one process. The widening of int8 to float32 sets the pace, not the FMA
// chain. (The same loop written without U ran 6% slower: GCC compiles it differently.)
constexpr int64_t kAccumulators = 1;

template <int64_t M, int64_t U>
void rows_times_int8(const float* x, const int8_t* q, const float* scale, const float* bias, float* y, int64_t K,
                     int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int64_t step = kLanes * U;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* qn = q + n * K;
    const int8_t* ahead = n + kAhead < N ? qn + kAhead * K : qn;  // never past the end of q
    vf acc[M][U] = {};
    int64_t k = 0;
    for (; k + step <= K; k += step) {
      if (k % 64 < step) {  // once per 64-byte line of the row kAhead on
        for (int64_t line = 0; line < step; line += 64) __builtin_prefetch(ahead + k + line, 0, 0);
      }
      for (int64_t u = 0; u < U; ++u) {
        const vf wv = load_int8(qn + k + kLanes * u);
        for (int64_t m = 0; m < M; ++m) acc[m][u] += load(x + m * K + k + kLanes * u) * wv;
      }
    }
    for (; k + kLanes <= K; k += kLanes) {
      const vf wv = load_int8(qn + k);
      for (int64_t m = 0; m < M; ++m) acc[m][0] += load(x + m * K + k) * wv;
    }
    const float b = bias ? bias[n] : 0.f;
    for (int64_t m = 0; m < M; ++m) {
      vf sum = acc[m][0];
      for (int64_t u = 1; u < U; ++u) sum += acc[m][u];
      float dot = hsum(sum);
      for (int64_t j = k; j < K; ++j) dot += x[m * K + j] * static_cast<float>(qn[j]);  // K % kLanes
      y[m * N + n] = dot * scale[n] + b;
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "modserve_int8.linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat,
              "modserve_int8.linear: float32 x, int8 qweight, float32 scales");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1) &&
                  scales.numel() == qweight.size(0),
              "modserve_int8.linear: x [M, K], qweight [N, K], scales [N]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  if (M > kMaxRows) {  // a GEMM's worth of rows: widen q once and multiply in float32, as the dequant path does
    at::Tensor y = at::linear(x, qweight.to(at::kFloat)).mul_(scales);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  const at::Tensor xc = x.contiguous(), qc = qweight.contiguous(), sc = scales.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  modserve::for_row_passes(M, N, kPassRows, [&](int64_t r, int64_t rows, int64_t begin, int64_t end) {
    modserve::with_rows(rows, [&](auto m) {
      constexpr int64_t R = decltype(m)::value;
      rows_times_int8<R, kAccumulators>(xp + r * K, qp, sp, bp, yp + r * N, K, N, begin, end);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(modserve_int8, m) {
  m.def("linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
