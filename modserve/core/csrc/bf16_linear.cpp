// y = x @ W.T (+ b) for a few float32 rows x against bfloat16 weights W, accumulating in
// float32, on the CPU.
//
// With a handful of rows a linear layer is bound by reading its weights. A bfloat16
// checkpoint's weights are exact in bfloat16, so reading that copy moves half the bytes
// of float32 ones and gives float32 results (a bf16 value widened is a float32 with
// zeroed low bits). Every weight row is read once for up to 8 rows of x (9-16 rows take
// two passes): threads split the output features, and x (a few rows of `in` floats)
// stays in cache.
//
// Registered as torch.ops.modserve_cpu.bf16_linear and .few_rows_linear (built by
// modserve/core/cpu_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u8x32 __attribute__((vector_size(32)));
typedef uint16_t u8x16 __attribute__((vector_size(16)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline v8 load8_bf16(const uint16_t* p) {  // eight bfloat16 -> eight float32
  u8x16 h;
  std::memcpy(&h, p, sizeof h);
  const u8x32 w = __builtin_convertvector(h, u8x32) << 16;
  v8 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

inline float hsum(v8 v) {
  const v8 a = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8 b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}

constexpr int64_t kPassRows = 8;  // rows one pass over W takes: their accumulators stay in registers
constexpr int64_t kMaxRows = 16;  // beyond two passes, float32 GEMMs win (measured here)

// Row n of W is K contiguous bf16 values. U accumulators per row of x split K so the
// FMAs of one output do not wait on each other (one chain runs at the FMA latency, below
// the memory bandwidth for one or two rows); the weight row kAhead rows on is prefetched,
// a cache line per line read, since rows are read one after another. Together they made
// one-row decode ~15% faster here (12 layers at 1 row: 10.6 ms against 12.8).
constexpr int64_t kAhead = 2;

template <int64_t M, int64_t U>
void rows_times_weights(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
                        int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* wn = w + n * K;
    const uint16_t* ahead = n + kAhead < N ? wn + kAhead * K : wn;  // never past the end of W
    v8 acc[M][U] = {};
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
      if (8 * U >= 32 || k % 32 == 0) __builtin_prefetch(ahead + k, 0, 0);  // 32 bf16: a 64-byte line
      for (int64_t u = 0; u < U; ++u) {
        const v8 wv = load8_bf16(wn + k + 8 * u);
        for (int64_t m = 0; m < M; ++m) acc[m][u] += load8(x + m * K + k + 8 * u) * wv;
      }
    }
    for (; k < K; k += 8) {
      const v8 wv = load8_bf16(wn + k);
      for (int64_t m = 0; m < M; ++m) acc[m][0] += load8(x + m * K + k) * wv;
    }
    const float b = bias ? bias[n] : 0.f;
    for (int64_t m = 0; m < M; ++m) {
      v8 sum = acc[m][0];
      for (int64_t u = 1; u < U; ++u) sum += acc[m][u];
      y[m * N + n] = hsum(sum) + b;
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "modserve_cpu.bf16_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16,
              "modserve_cpu.bf16_linear: float32 x, bfloat16 weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "modserve_cpu.bf16_linear: x [M, K], weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kMaxRows && K % 8 == 0, "modserve_cpu.bf16_linear: at most 16 rows, K a multiple of 8");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // no rows: nothing to compute (and no pass to size)
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // More than 8 rows: equal passes of up to 8 (12 rows: 6 + 6), each reading W once. Two
  // passes over bf16 weights move as many bytes as one over float32 ones, without the
  // GEMM's cost per row (9-16 rows: 10-25% less time than oneDNN's packed GEMM here).
  const int64_t passes = (M + kPassRows - 1) / kPassRows, per_pass = (M + passes - 1) / passes;
  for (int64_t r = 0; r < M; r += per_pass) {
    const int64_t rows = std::min(per_pass, M - r);
    const float* xr = xp + r * K;
    float* yr = yp + r * N;
    // grain: at least 64 output features (~100 KB of weights) per task
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      switch (rows) {
        case 1: rows_times_weights<1, 4>(xr, wp, bp, yr, K, N, begin, end); break;
        case 2: rows_times_weights<2, 2>(xr, wp, bp, yr, K, N, begin, end); break;
        case 3: rows_times_weights<3, 2>(xr, wp, bp, yr, K, N, begin, end); break;
        case 4: rows_times_weights<4, 2>(xr, wp, bp, yr, K, N, begin, end); break;
        case 5: rows_times_weights<5, 1>(xr, wp, bp, yr, K, N, begin, end); break;
        case 6: rows_times_weights<6, 1>(xr, wp, bp, yr, K, N, begin, end); break;
        case 7: rows_times_weights<7, 1>(xr, wp, bp, yr, K, N, begin, end); break;
        default: rows_times_weights<8, 1>(xr, wp, bp, yr, K, N, begin, end); break;
      }
    });
  }
  return y;
}

// The route a linear with a bf16 copy takes, chosen per call by its row count: up to
// kMaxRows, bf16_linear on `decode_weight`; beyond, float32 (oneDNN's packed GEMM when the
// layer has `packed_weight`, modserve::packed_linear from modserve/core/prepack.py). In C++
// so a decode step's ~50 linears pay no Python dispatch.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& decode_weight,
                           const c10::optional<at::Tensor>& packed_weight, const c10::optional<at::Tensor>& bias) {
  if (x.size(0) <= kMaxRows) return bf16_linear(x, decode_weight, bias);
  if (packed_weight.has_value() && packed_weight->defined()) {
    static const auto packed_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("modserve::packed_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
    return packed_linear.call(x, *packed_weight, bias);
  }
  return at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY(modserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor decode_weight, Tensor? packed_weight, Tensor? bias) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  // every backend: a oneDNN-packed weight makes a call dispatch as MkldnnCPU, not CPU
  m.impl("few_rows_linear", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(few_rows_linear));
}
