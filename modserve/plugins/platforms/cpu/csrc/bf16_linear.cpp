// y = x @ W.T (+ b) for a few float32 rows x against bfloat16 weights W, accumulating in
// float32, on the CPU.
//
// With a handful of rows a linear layer is bound by reading its weights. A bfloat16
// checkpoint's weights are exact in bfloat16, so reading that copy moves half the bytes
// of float32 ones and gives float32 results (a bf16 value widened is a float32 with
// zeroed low bits). Every weight row is read once for up to 8 rows of x (9-16 rows take
// two passes): threads claim the output features in pieces (claims.h), and x (a few
// rows of `in` floats) stays in cache.
//
// Beyond a few rows, panel_linear (below) is the float32 GEMM of batched steps.
//
// Registered as torch.ops.modserve_cpu.bf16_linear, .panel_linear, .few_rows_linear and
// .bf16_gemm_linear, with .pack_tiles and .set_tiles_amx (built by
// modserve/plugins/platforms/cpu/kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <immintrin.h>

#include "row_passes.h"
#include "vec8.h"  // v8, load8 (float32 and bf16), hsum

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using modserve::hsum;
using modserve::load8;  // float32, or bf16 widened
using modserve::v8;

inline v8 load8_bf16(const uint16_t* p) { return load8(p); }  // eight bfloat16 -> eight float32

// The same as one vpmovzxwd and a shift (GCC makes five instructions of vec8.h's form).
// 5-10% faster where 5 or more rows share each weight load; slower here at 1 row (6.8
// against 7.8 ms over the model's weights), so only the many-row loops use it.
inline v8 load8_bf16_vpmovzx(const uint16_t* p) {
#ifdef __AVX2__
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<v8>(_mm256_castsi256_ps(w));
#else
  return load8_bf16(p);
#endif
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
        const v8 wv = M >= 5 ? load8_bf16_vpmovzx(wn + k + 8 * u) : load8_bf16(wn + k + 8 * u);
        for (int64_t m = 0; m < M; ++m) acc[m][u] += load8(x + m * K + k + 8 * u) * wv;
      }
    }
    for (; k < K; k += 8) {
      const v8 wv = M >= 5 ? load8_bf16_vpmovzx(wn + k) : load8_bf16(wn + k);
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

// Five or six rows of x (a step of 5-6 or 9-12 sequences): two weight rows at a time, so
// each x load feeds two FMAs; with one, loads of x bound the loop (here 15-25% faster
// than one row at a time). The same FMA chain per output as rows_times_weights<M, 1>.
template <int64_t M>
void rows_times_weight_pairs(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
                             int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const uint16_t* w0 = w + n * K;
    const uint16_t* w1 = w0 + K;
    const uint16_t* ahead = n + 3 + kAhead < N ? w0 + (2 + kAhead) * K : w0;  // the pair kAhead pairs on
    v8 a0[M] = {}, a1[M] = {};
    for (int64_t k = 0; k < K; k += 8) {
      if (k % 32 == 0) {  // 32 bf16: a 64-byte line of each row
        __builtin_prefetch(ahead + k, 0, 0);
        __builtin_prefetch(ahead + K + k, 0, 0);
      }
      const v8 wv0 = load8_bf16_vpmovzx(w0 + k), wv1 = load8_bf16_vpmovzx(w1 + k);
      for (int64_t m = 0; m < M; ++m) {
        const v8 xv = load8(x + m * K + k);
        a0[m] += xv * wv0;
        a1[m] += xv * wv1;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      y[m * N + n] = hsum(a0[m]) + (bias ? bias[n] : 0.f);
      y[m * N + n + 1] = hsum(a1[m]) + (bias ? bias[n + 1] : 0.f);
    }
  }
  if (n < n_end) rows_times_weights<M, 1>(x, w, bias, y, K, N, n, n_end);
}

// -- the same at AVX-512 width, for CPUs without AVX512-BF16 ---------------------------
//
// Where the build has AVX-512F, a pass can widen 16 bf16 weights at once (one vpmovzxwd of a
// 32-byte load and a shift) into one 16-float register. Taken where the CPU has AVX-512F but
// no AVX512-BF16, such as Intel's Ice Lake Xeons (CpuFeatures.few_rows_floats in features.py,
// through set_few_rows_floats); elsewhere the 8-float loops above, the ones measured on Zen 4.
//
// P weight rows are read side by side, each x load feeding P FMAs: P streams through
// memory at once keep more cache-line fills in flight on one core than a single stream with
// the hardware prefetcher alone, and P independent FMA chains per row of x hide the FMA
// latency as the split accumulators above do. Each stream prefetches kAheadBytes on, one line
// per 64 bytes read. One chain per output over K in steps of 16, summed across the lanes at
// the end: the products are those of the 8-float loops, their float32 sums in another order.
#ifdef __AVX512F__
constexpr bool kHave16 = true;
constexpr int64_t kAheadBytes = 512;

inline __m512 widen16(const uint16_t* p) {  // sixteen bf16 -> sixteen float32, exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 widen8(const uint16_t* p) {  // eight bf16 into the low lanes, zeros above (K's tail)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_zextsi128_si256(h)), 16));
}

template <int64_t M, int64_t P>
void rows_times_weights16(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
                          int64_t n_begin, int64_t n_end) {
  const char* w_end = reinterpret_cast<const char*>(w + N * K);
  int64_t n = n_begin;
  for (; n + P <= n_end; n += P) {
    const uint16_t* wn = w + n * K;
    __m512 acc[M][P];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      if (k % 32 == 0) {  // 32 bf16: a 64-byte line of each row
        for (int64_t p = 0; p < P; ++p) {
          const char* ahead = reinterpret_cast<const char*>(wn + p * K + k) + kAheadBytes;
          if (ahead < w_end) _mm_prefetch(ahead, _MM_HINT_T0);  // never past the end of W
        }
      }
      __m512 wv[P];
      for (int64_t p = 0; p < P; ++p) wv[p] = widen16(wn + p * K + k);
      for (int64_t m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * K + k);
        for (int64_t p = 0; p < P; ++p) acc[m][p] = _mm512_fmadd_ps(xv, wv[p], acc[m][p]);
      }
    }
    if (k < K) {  // K % 16 == 8
      __m512 wv[P];
      for (int64_t p = 0; p < P; ++p) wv[p] = widen8(wn + p * K + k);
      for (int64_t m = 0; m < M; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(0xff, x + m * K + k);
        for (int64_t p = 0; p < P; ++p) acc[m][p] = _mm512_fmadd_ps(xv, wv[p], acc[m][p]);
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t p = 0; p < P; ++p) y[m * N + n + p] = _mm512_reduce_add_ps(acc[m][p]) + (bias ? bias[n + p] : 0.f);
  }
  if constexpr (P > 1) {
    if (n < n_end) rows_times_weights16<M, 1>(x, w, bias, y, K, N, n, n_end);
  }
}

// Weight rows side by side for R rows of x: four up to four rows (at most 16 sums in
// registers), three beyond (at most 24 of the 32).
constexpr int64_t weight_rows16(int64_t rows) { return rows <= 4 ? 4 : 3; }
#else
constexpr bool kHave16 = false;
#endif

// The vector width bf16_linear computes in: 8, or 16 where the build has AVX-512F and
// set_few_rows_floats(16) asked for it (once per process, at the route's choice).
std::atomic<int64_t> few_rows_floats{8};

void set_few_rows_floats(int64_t floats) {
  TORCH_CHECK(floats == 8 || floats == 16, "modserve_cpu.set_few_rows_floats: 8 or 16, not ", floats);
  TORCH_CHECK(floats == 8 || kHave16, "modserve_cpu.set_few_rows_floats: 16-float vectors need a build with "
              "AVX-512F, which this CPU lacks");
  few_rows_floats.store(floats);
}

int64_t get_few_rows_floats() { return few_rows_floats.load(); }

bool few_rows_avx512_built() { return kHave16; }

// -- float32 GEMM on panel-packed weights ---------------------------------------------
//
// W [N, K] packed as panels [ceil(N / 16), K, 16] (zero rows pad the last): panel p holds
// output features 16p..16p+15, one 16-float row per k. A tile of MB (<= 6) rows of x
// times one panel keeps its 6 x 2 vectors of sums in registers for the whole of K: per k,
// two loads of the panel row, MB broadcasts of x and 2 MB FMAs. The panel (K x 64 bytes)
// stays in cache while every row tile of x passes over it; x goes by in chunks of
// kChunkRows rows so a chunk stays in L2. Each output is one float32 FMA chain over k in
// order, whatever the row count: a row's result does not depend on its batch.
// Here it ran 1.15-1.3x oneDNN's packed GEMM from 24 to 2048 rows (the 4 linears of a
// layer: 133 against 107 GFLOP/s at 64 rows, 164 against 141 at 512). Each tile also
// prefetches a share of the next panel, so the thread's first tile over it does not wait
// on DRAM: that tile reads 64 bytes per 6 cycles, more than a core's share of the
// bandwidth (5-10% faster at 24-256 rows over 12 layers' weights).
constexpr int64_t kPanel = 16;
constexpr int64_t kTileRows = 6;
constexpr int64_t kChunkRows = 256;
constexpr int64_t kClaimPanels = 2;  // threads take panels two at a time (claims.h)
constexpr int64_t kFewTiles = 8;     // below this many row tiles, the next panel is prefetched into L2

inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }  // one vbroadcastss, no add

template <int MB>
void panel_tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                int64_t cols, const float* next, int64_t first, int64_t every) {
  v8 acc[MB][2] = {};
  int64_t fetch = next ? first : K;
  for (int64_t k = 0; k < K; ++k) {
    if (k == fetch) {  // a line of the next panel: 16 floats
      // Few tiles a panel: each tile asks for many lines, more than L1 tracks at once, so
      // they go to L2 (17-32 rows: 10-23% faster than into L1); with many, into L1.
      if (every < kFewTiles) __builtin_prefetch(next + k * kPanel, 0, 1);
      else __builtin_prefetch(next + k * kPanel, 0, 3);
      fetch += every;
    }
    const v8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < MB; ++m) {
      const v8 xb = splat(x[m * K + k]);
      acc[m][0] += xb * w0;
      acc[m][1] += xb * w1;
    }
  }
  float out[kPanel];
  for (int m = 0; m < MB; ++m) {
    std::memcpy(out, &acc[m][0], sizeof(v8));
    std::memcpy(out + 8, &acc[m][1], sizeof(v8));
    for (int64_t c = 0; c < cols; ++c) y[m * N + c] = out[c] + (bias ? bias[c] : 0.f);
  }
}

// -- the same GEMM at AVX-512 width ---------------------------------------------------
//
// On a CPU that computes in 16-float vectors (set_few_rows_floats(16): AVX-512F without
// AVX512-BF16, such as an Ice Lake Xeon), a panel row is one register. A tile of MB (<= 12)
// rows of x times two neighbouring panels keeps 12 x 2 registers of sums: per k, two loads,
// MB broadcasts and 2 MB FMAs, twice the columns per FMA of the 8-float tile above, with the
// same panels, the same claims and the same FMA chain per output (bit-identical results),
// from kMinRows16 rows.
#ifdef __AVX512F__
constexpr int64_t kTileRows16 = 12;
// Fewer rows (17-23) are closer to streaming the weights than to computing on them, and
// the 8-float tiles stream them faster there (scripts/linear_routes.py).
constexpr int64_t kMinRows16 = 24;

template <int MB, int NP>
void panel_tile16(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                  int64_t cols, const float* next, int64_t next_panels, int64_t first, int64_t every) {
  const int64_t stride = K * kPanel;  // from one panel to the next
  __m512 acc[MB][NP];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t fetch = next_panels ? first : K;
  for (int64_t k = 0; k < K; ++k) {
    if (k == fetch) {  // a line of each of the next panels, as panel_tile does
      for (int64_t j = 0; j < next_panels; ++j) {
        if (every < kFewTiles) _mm_prefetch(reinterpret_cast<const char*>(next + j * stride + k * kPanel), _MM_HINT_T1);
        else _mm_prefetch(reinterpret_cast<const char*>(next + j * stride + k * kPanel), _MM_HINT_T0);
      }
      fetch += every;
    }
    __m512 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_ps(panel + j * stride + k * kPanel);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t c = std::min(kPanel, cols - j * kPanel);  // > 0: a claimed panel holds a feature
    const __mmask16 mask = static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * N + j * kPanel, mask, _mm512_add_ps(acc[m][j], b));
  }
}

template <int NP>
void panel_rows16(int64_t rows, const float* x, int64_t K, const float* panel, const float* bias, float* y,
                  int64_t N, int64_t cols, const float* next, int64_t next_panels, int64_t first, int64_t every) {
  switch (rows) {
    case 1: return panel_tile16<1, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 2: return panel_tile16<2, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 3: return panel_tile16<3, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 4: return panel_tile16<4, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 5: return panel_tile16<5, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 6: return panel_tile16<6, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 7: return panel_tile16<7, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 8: return panel_tile16<8, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 9: return panel_tile16<9, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 10: return panel_tile16<10, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    case 11: return panel_tile16<11, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
    default: return panel_tile16<12, NP>(x, K, panel, bias, y, N, cols, next, next_panels, first, every);
  }
}

// panel_linear's loop over 16-float tiles: claims of two panels, each taken whole by a tile.
void panel_linear16(const float* xp, const float* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t P,
                    int64_t N) {
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - r0);
    // rows split evenly over the fewest tiles (17: 9 + 8, not 12 + 5): a short tile does
    // fewer FMAs per load of the panels
    const int64_t tiles = (rows + kTileRows16 - 1) / kTileRows16;
    const int64_t tile_rows = (rows + tiles - 1) / tiles;
    modserve::parallel_claims(P, kClaimPanels, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; p += 2) {
        const int64_t np = std::min<int64_t>(2, end - p);
        const float* panel = wp + p * K * kPanel;
        const float* pb = bp ? bp + p * kPanel : nullptr;
        const int64_t cols = std::min(np * kPanel, N - p * kPanel);
        const float* next = wp + (p + np) * K * kPanel;
        const int64_t next_panels = std::min<int64_t>(np, P - p - np);  // the panels after these, if any
        for (int64_t m = r0, t = 0; m < r0 + rows; m += tile_rows, ++t) {
          const float* xm = xp + m * K;
          float* ym = yp + m * N + p * kPanel;
          const int64_t mb = std::min(tile_rows, r0 + rows - m);
          if (np == 2) panel_rows16<2>(mb, xm, K, panel, pb, ym, N, cols, next, next_panels, t, tiles);
          else panel_rows16<1>(mb, xm, K, panel, pb, ym, N, cols, next, next_panels, t, tiles);
        }
      }
    });
  }
}
#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "modserve_cpu.panel_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "modserve_cpu.panel_linear: float32 x and panels");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && x.size(1) == panels.size(1),
              "modserve_cpu.panel_linear: x [M, K], panels [ceil(N / 16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "modserve_cpu.panel_linear: ", P,
              " panels do not hold ", N, " output features");
  const at::Tensor xc = x.contiguous(), wc = panels.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef __AVX512F__
  if (few_rows_floats.load(std::memory_order_relaxed) == 16 && M >= kMinRows16) {
    panel_linear16(xp, wp, bp, yp, M, K, P, N);
    return y;
  }
#endif
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - r0);
    // tile t prefetches the next panel's lines t, t + tiles, ... (see above); the panel
    // after a claim may go to the other thread, and then the prefetch only spent bandwidth
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    modserve::parallel_claims(P, kClaimPanels, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = wp + p * K * kPanel;
        const float* pb = bp ? bp + p * kPanel : nullptr;
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        const float* next = p + 1 < P ? panel + K * kPanel : nullptr;
        for (int64_t m = r0, t = 0; m < r0 + rows; m += kTileRows, ++t) {
          const float* xm = xp + m * K;
          float* ym = yp + m * N + p * kPanel;
          switch (std::min(kTileRows, r0 + rows - m)) {
            case 1: panel_tile<1>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
            case 2: panel_tile<2>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
            case 3: panel_tile<3>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
            case 4: panel_tile<4>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
            case 5: panel_tile<5>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
            default: panel_tile<6>(xm, K, panel, pb, ym, N, cols, next, t, tiles); break;
          }
        }
      }
    });
  }
  return y;
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
  [[maybe_unused]] const bool wide = few_rows_floats.load(std::memory_order_relaxed) == 16;  // read by AVX-512 builds
  modserve::for_row_passes(M, N, kPassRows, [&](int64_t r, int64_t rows, int64_t begin, int64_t end) {
    modserve::with_rows(rows, [&](auto m) {
      constexpr int64_t R = decltype(m)::value;
      const float* xr = xp + r * K;
      float* yr = yp + r * N;
#ifdef __AVX512F__
      if (wide) return rows_times_weights16<R, weight_rows16(R)>(xr, wp, bp, yr, K, N, begin, end);
#endif
      if constexpr (R == 5 || R == 6) {
        rows_times_weight_pairs<R>(xr, wp, bp, yr, K, N, begin, end);
      } else {
        rows_times_weights<R, modserve::accumulators(R)>(xr, wp, bp, yr, K, N, begin, end);
      }
    });
  });
  return y;
}

// The route a linear with a bf16 copy takes, chosen per call by its row count: up to
// kMaxRows, bf16_linear on `decode_weight`; beyond, float32: panel_linear when the layer's
// `packed_weight` is panels, oneDNN's packed GEMM when it is a oneDNN tensor
// (modserve::packed_linear from modserve/core/prepack.py). In C++ so a step's ~50 linears
// pay no Python dispatch.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& decode_weight,
                           const c10::optional<at::Tensor>& packed_weight, const c10::optional<at::Tensor>& bias) {
  if (x.size(0) <= kMaxRows) return bf16_linear(x, decode_weight, bias);
  if (packed_weight.has_value() && packed_weight->defined()) {
    if (!packed_weight->is_mkldnn()) return panel_linear(x, *packed_weight, weight.size(0), bias);
    static const auto packed_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("modserve::packed_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
    return packed_linear.call(x, *packed_weight, bias, weight.size(0));
  }
  return at::linear(x, weight, bias);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kHaveDot = true;
constexpr int64_t kDotRows = 4;  // rows per pass of the dot kernel
constexpr int64_t kDotMaxRows = 3;  // beyond, oneDNN's GEMM reads the weights as fast (scripts/linear_routes.py)
constexpr int64_t kDotOutputs = 4;  // output features a thread computes together
constexpr int64_t kDotClaim = 16;  // output features a thread claims at a time (claims.h)

// y[r, n] = dot(x[r, :], W[n, :]) for R rows x [R, K] and outputs n in [begin, end), both
// bf16, with vdpbf16ps: 32 products a weight load, float32 sums. kDotOutputs weight rows
// are streamed side by side so each x load serves all of them; K % 32 takes masked loads.
template <int64_t R>
void dot_rows(const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  const int64_t tail = K % 32;
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((1u << tail) - 1) : 0;
  for (int64_t n = begin; n < end; n += kDotOutputs) {
    const int64_t outs = std::min<int64_t>(kDotOutputs, end - n);
    __m512 acc[R][kDotOutputs];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t o = 0; o < kDotOutputs; ++o) acc[r][o] = _mm512_setzero_ps();
    const uint16_t* wn = w + n * K;
    int64_t k = 0;
    if (outs == kDotOutputs) {
      for (; k + 32 <= K; k += 32) {
        __m512i wv[kDotOutputs];
        for (int64_t o = 0; o < kDotOutputs; ++o) wv[o] = _mm512_loadu_si512(wn + o * K + k);
        for (int64_t r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
          for (int64_t o = 0; o < kDotOutputs; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, (__m512bh)wv[o]);
        }
      }
    }
    // The last features of a claim (fewer than kDotOutputs) and K's tail: masked, one by one.
    for (int64_t o = 0; o < outs; ++o) {
      for (int64_t kk = (outs == kDotOutputs ? k : 0); kk < K; kk += 32) {
        const __mmask32 m = kk + 32 <= K ? static_cast<__mmask32>(~0u) : tail_mask;
        const __m512i wv = _mm512_maskz_loadu_epi16(m, wn + o * K + kk);
        for (int64_t r = 0; r < R; ++r)
          acc[r][o] = _mm512_dpbf16_ps(acc[r][o], (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + kk), (__m512bh)wv);
      }
      for (int64_t r = 0; r < R; ++r) y[r * N + n + o] = _mm512_reduce_add_ps(acc[r][o]);
    }
  }
}

// x [M, K] float32, M <= kDotMaxRows; weight [N, K] bf16 -> [M, N] float32: x rounded to
// bf16 once, then passes of up to kDotRows rows, each streaming W once, the output
// features claimed by the threads a few at a time.
at::Tensor bf16_dot_linear(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < M; r += kDotRows) {
    const int64_t rows = std::min(kDotRows, M - r);
    modserve::parallel_claims(N, kDotClaim, [&](int64_t begin, int64_t end) {
      const uint16_t* xr = xp + r * K;
      float* yr = yp + r * N;
      switch (rows) {
        case 1: dot_rows<1>(xr, wp, yr, K, N, begin, end); break;
        case 2: dot_rows<2>(xr, wp, yr, K, N, begin, end); break;
        case 3: dot_rows<3>(xr, wp, yr, K, N, begin, end); break;
        default: dot_rows<4>(xr, wp, yr, K, N, begin, end); break;
      }
    });
  }
  return y;
}
#else
constexpr bool kHaveDot = false;
constexpr int64_t kDotMaxRows = 0;
at::Tensor bf16_dot_linear(const at::Tensor& x, const at::Tensor&) {
  TORCH_CHECK(false, "bf16_dot_linear: built for a CPU without AVX512-BF16");
  return x;
}
#endif

constexpr int64_t kPackedMaxRows = 256;  // beyond, a prefill's GEMM: the plain layout ran faster

// The AMX tiles' own layout of W (where the CPU has AMX-BF16: torch's cpublas::could_pack):
// blocks of kTileCols output features, each [K / 2, kTileCols, 2] (oneDNN's VNNI pairs),
// packed once at load. Up to kPackedMaxRows rows, x (rounded to bf16) is the brgemm's A
// operand and each block of W its B, streamed from memory in order (one row: vdpbf16ps
// reads the blocks instead; from two tiles of rows, tiles_amx: both below); the float32 sums
// land in y directly, unrounded. Against oneDNN's packed GEMM of the weights in its own
// layout, this read them faster at 2 to 16 rows and as fast at one (scripts/linear_routes.py,
// docs/benchmarks.md).
constexpr int64_t kTileCols = 64;
constexpr int64_t kAmxRows = 16;  // rows of an AMX tile
// Rows beyond one tile where tiles_amx does not apply (K not a multiple of 32): from
// kTilesChunkRows rows, each brgemm call takes kTilesChunk of K (x's
// chunk near L1 at 64 rows), the sums carried in y from chunk to chunk; below, a call per chunk
// cost more than x's reuse saved, and the rows go a tile at a time over the whole of K instead
// (docs/benchmarks.md). A K that is not a multiple of kTilesChunk is never chunked.
constexpr int64_t kTilesChunk = 256;
constexpr int64_t kTilesChunkRows = 48;

// One row (a single stream's decode step, where the CPU has AVX512-BF16, as every CPU with
// AMX does) is read by vdpbf16ps instead of the brgemm: each block streamed once, in order,
// with a software prefetch kTilesPrefetch bytes ahead of the loads, which the brgemm's tile
// loads have no place for. The hardware prefetchers alone kept the brgemm's reads of the
// weights below a plain sum's pace over memory, the more so the slower the machine's memory
// ran that day (docs/benchmarks.md). From two rows the brgemm reads as fast as at one, and
// the dot products' cost grows with the rows.
constexpr int64_t kTilesPrefetch = 2048;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// y[0 : cols] = x . W's block, for one row x as bf16 pairs [K / 2] and one block of W's tiles
// ([K / 2, kTileCols, 2] bf16): float32 sums of exact products, K in order.
void tiles_dot_block(const uint32_t* x, const at::BFloat16* block, int64_t K, float* y, int64_t cols) {
  static_assert(kTileCols == 64, "a block's K pair is four 16-float vectors");
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const char* w = reinterpret_cast<const char*>(block);
  for (int64_t kp = 0; kp < K / 2; ++kp, w += 256) {  // 256 bytes: one K pair of 64 features
    _mm_prefetch(w + kTilesPrefetch, _MM_HINT_T0);
    _mm_prefetch(w + kTilesPrefetch + 64, _MM_HINT_T0);
    _mm_prefetch(w + kTilesPrefetch + 128, _MM_HINT_T0);
    _mm_prefetch(w + kTilesPrefetch + 192, _MM_HINT_T0);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp]));
    for (int64_t j = 0; j < 4; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(w + 64 * j), xv);
  }
  for (int64_t j = 0; j < 4; ++j) {
    const int64_t lanes = std::clamp<int64_t>(cols - 16 * j, 0, 16);  // a partial last block stores its features
    _mm512_mask_storeu_ps(y + 16 * j, static_cast<__mmask16>((1u << lanes) - 1), acc[j]);
  }
}

// y [N] from one row x [K] bf16 and W's tiles.
void tiles_dot(const at::BFloat16* x, const at::BFloat16* tiles, int64_t blocks, int64_t K, int64_t N, float* y) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  // A fixed split: each thread's blocks are contiguous, so the prefetch past the end of one
  // fetches the start of the thread's next.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      tiles_dot_block(xp, tiles + b * K * kTileCols, K, y + b * kTileCols, std::min(kTileCols, N - b * kTileCols));
  });
}
#else
void tiles_dot(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "tiles_dot: built for a CPU without AVX512-BF16");
}
#endif

bool tiles_ready() { return at::native::cpublas::could_pack(at::kBFloat16); }

bool is_tiles(const c10::optional<at::Tensor>& packed, const at::Tensor& weight) {
  return packed.has_value() && packed->defined() && !packed->is_mkldnn() && packed->dim() == 2 &&
         packed->size(1) == weight.size(1) * kTileCols;
}

at::Tensor pack_tiles(const at::Tensor& weight) {  // [N, K] bf16 -> [ceil(N / 64), K * 64]
  TORCH_CHECK(tiles_ready(), "pack_tiles: this CPU has no AMX-BF16 tiles");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(1) % 2 == 0,
              "pack_tiles: bf16 weight [N, K], K even");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kTileCols - 1) / kTileCols;
  at::Tensor wt = at::zeros({K, blocks * kTileCols}, weight.options());  // W^T, zero-padded to whole blocks
  wt.narrow(1, 0, N).copy_(weight.t());
  at::Tensor tiles = at::empty({blocks, K * kTileCols}, weight.options());
  const auto* src = wt.data_ptr<at::BFloat16>();
  auto* dst = tiles.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      at::native::cpublas::pack(K, kTileCols, blocks * kTileCols, kTileCols, at::kBFloat16, at::kBFloat16,
                                src + b * kTileCols, dst + b * K * kTileCols);
    }
  });
  return tiles;
}

// y [rows, N] from x [rows, lda] bf16 (rows: whole tiles) and W's tiles, by the brgemm.
void tiles_brgemm(const at::BFloat16* ap, int64_t lda, const at::BFloat16* bp, int64_t blocks, int64_t rows,
                  int64_t K, int64_t N, float* yp) {
  const int64_t chunk = K % kTilesChunk == 0 ? kTilesChunk : K;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kTileCols, cols = std::min(kTileCols, N - n0);
      const at::BFloat16* block = bp + b * K * kTileCols;
      if (rows < kTilesChunkRows) {  // one tile of rows at a time: the block is in L2 after the first
        for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows)
          at::native::cpublas::brgemm(kAmxRows, cols, K, lda, kTileCols, N, /*add_C=*/false, ap + r0 * lda, block,
                                      yp + r0 * N + n0);
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += chunk)
        at::native::cpublas::brgemm(rows, cols, chunk, lda, kTileCols, N, /*add_C=*/k0 > 0, ap + k0,
                                    block + k0 * kTileCols, yp + n0);
    }
    at::native::cpublas::brgemm_release();
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// From two tiles of rows (32), the same product on the AMX tiles directly, for K a multiple of
// 32: the same sums as the brgemm's, bit for bit, read faster (docs/benchmarks.md). One tile
// of rows reads each block once, and the brgemm streams it as fast.
//
// A thread's blocks lie one after another in memory, and it reads them as one stream, a chunk
// of K at a time: every tile of rows takes its products over the chunk, the chunk being read
// from memory by the first tiles of rows and from cache by the others. Meanwhile the next
// chunk is prefetched, a share at each step, so that memory stays busy while the later tiles
// of rows compute; the brgemm, a call per block, has no place for that. A chunk is at most
// kAmxChunk of K (128 KiB of W), so the chunk being read and the next fit in L2 at once; the
// sums of a chunk after the first are added to those in y. The tiles are configured once per
// thread and call, not once per block.
//
// Eight tile registers: per two tiles of rows and half a block, four 16 x 16 float32 sums,
// two of x (16 rows x 32 K) and two of W (16 K pairs x 16 features, rows 256 bytes apart in a
// block), each x and W tile loaded once for two products; an odd last tile of rows takes the
// four W tiles of the whole block in turn. Each sum runs over K in order, 32 at a time.
constexpr bool kHaveAmx = true;
constexpr int64_t kAmxChunk = 1024;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the tiles' state only once asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, and asking again is harmless.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;  // 16 floats, 32 bf16 or 16 bf16 pairs
  }
  _tile_loadconfig(&config);
}

// Sums tiles 0-3 start from zero (the first chunk) or from y.
template <bool First>
inline void amx_start(float* y, int64_t ldy, int64_t down) {
  if constexpr (First) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, y, ldy * 4);
    _tile_loadd(1, y + 16, ldy * 4);
    _tile_loadd(2, y + down, ldy * 4);
    _tile_loadd(3, y + down + 16, ldy * 4);
  }
}

inline void amx_store(float* y, int64_t ldy, int64_t down) {
  _tile_stored(0, y, ldy * 4);
  _tile_stored(1, y + 16, ldy * 4);
  _tile_stored(2, y + down, ldy * 4);
  _tile_stored(3, y + down + 16, ldy * 4);
}

inline const char* prefetch(const char* ahead, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
  return ahead + bytes;
}

// y[0 : 16, 0 : 64] (+)= x[0 : 16, chunk] . the block's chunk w ([kc / 2, 64, 2]), an odd last
// tile of rows: per 32 of K, the four W tiles cover 16 whole K-pair rows of the block.
template <bool First>
void amx_tile_rows(const at::BFloat16* x, int64_t lda, const char* w, int64_t kc, float* y, int64_t ldy) {
  amx_start<First>(y, ldy, 32);
  for (int64_t k = 0; k < kc; k += 32, w += 4096) {
    _tile_loadd(4, x + k, lda * 2);
    _tile_loadd(5, w, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 64, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w + 128, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, w + 192, 256);
    _tile_dpbf16ps(3, 4, 6);
  }
  amx_store(y, ldy, 32);
}

// y[0 : 32, 0 : 64] (+)= x[0 : 32, chunk] . the block's chunk w, half a block at a time,
// prefetching `step` bytes from `ahead` per 32 of K; returns where the prefetch stopped.
template <bool First>
const char* amx_tile_pairs(const at::BFloat16* x, int64_t lda, const char* w, int64_t kc, float* y, int64_t ldy,
                           const char* ahead, int64_t step) {
  for (int64_t half = 0; half < 2; ++half) {
    float* yh = y + 32 * half;
    amx_start<First>(yh, ldy, 16 * ldy);
    const char* wk = w + 128 * half;
    for (int64_t k = 0; k < kc; k += 32, wk += 4096) {
      ahead = prefetch(ahead, step);
      _tile_loadd(4, x + k, lda * 2);
      _tile_loadd(6, wk, 256);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, wk + 64, 256);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x + 16 * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    amx_store(yh, ldy, 16 * ldy);
  }
  return ahead;
}

// Every tile of rows over one chunk of one block: y[0 : rows, 0 : 64] (+)= x[:, k0 : k0 + kc] . w.
template <bool First>
void amx_chunk(const at::BFloat16* x, int64_t lda, int64_t rows, const char* w, int64_t k0, int64_t kc, float* y,
               int64_t ldy, const char* ahead, int64_t step) {
  int64_t r0 = 0;
  for (; r0 + 32 <= rows; r0 += 32)
    ahead = amx_tile_pairs<First>(x + r0 * lda + k0, lda, w, kc, y + r0 * ldy, ldy, ahead, step);
  if (r0 < rows) amx_tile_rows<First>(x + r0 * lda + k0, lda, w, kc, y + r0 * ldy, ldy);
}

// y [rows, N] from x [rows, lda] bf16 (rows: whole tiles, at least two) and W's tiles; K % 32 == 0.
void tiles_amx(const at::BFloat16* ap, int64_t lda, const at::BFloat16* bp, int64_t blocks, int64_t rows, int64_t K,
               int64_t N, float* yp) {
  int64_t kc = std::min(K, kAmxChunk);
  while (K % kc) kc -= 32;  // K % 32 == 0: ends at a divisor
  const int64_t chunk_bytes = kc * kTileCols * 2;
  // a share of the next chunk per step of two tiles of rows: all of it over their steps
  const int64_t step = (chunk_bytes / ((rows / 32) * 2 * (kc / 32)) + 63) / 64 * 64;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    thread_local std::vector<float> edge;  // a partial last block's sums
    const char* stream_end = reinterpret_cast<const char*>(bp + end * K * kTileCols);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kTileCols, cols = std::min(kTileCols, N - n0);
      const char* block = reinterpret_cast<const char*>(bp + b * K * kTileCols);
      float* y = yp + n0;
      int64_t ldy = N;
      if (cols < kTileCols) {
        edge.resize(rows * kTileCols);
        y = edge.data();
        ldy = kTileCols;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const char* w = block + k0 * kTileCols * 2;
        const char* ahead = w + chunk_bytes < stream_end ? w + chunk_bytes : nullptr;
        const int64_t s = ahead ? step : 0;
        if (k0 == 0)
          amx_chunk<true>(ap, lda, rows, w, k0, kc, y, ldy, ahead, s);
        else
          amx_chunk<false>(ap, lda, rows, w, k0, kc, y, ldy, ahead, s);
      }
      if (cols < kTileCols)
        for (int64_t r = 0; r < rows; ++r) std::memcpy(yp + r * N + n0, y + r * kTileCols, cols * sizeof(float));
    }
    _tile_release();
    at::native::cpublas::brgemm_release();  // torch's brgemm configures the tiles again on its next call
  });
}
#else
constexpr bool kHaveAmx = false;
bool amx_permitted() { return false; }
void tiles_amx(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "tiles_amx: built for a CPU without AMX-BF16");
}
#endif

// dst[0 : n] = src[0 : n] rounded to bf16 as torch rounds (vec8.h's to_bf16, which the compiler
// vectorizes), on the calling thread: a step's x is a few thousand values a row, which
// Tensor.copy_ splits over the threads at a cost of the order of the work.
void round_to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) bits[i] = modserve::to_bf16(src[i]);
}

// Whether tiles_amx takes the rows it applies to (set_tiles_amx(false): the brgemm takes them, to
// time one against the other in scripts/linear_routes.py).
std::atomic<bool> tiles_amx_on{true};

void set_tiles_amx(bool on) { tiles_amx_on.store(on); }

// y [M, N] float32 = x @ W.T (+ b) from W's tiles; x float32 or bf16, rounded to bf16 either way.
at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return at::zeros({0, N}, x.options().dtype(at::kFloat));
  // Rows padded to a whole tile of 16 (zeros in, discarded out): the tiles multiply 16 rows
  // in the time of one, and oneDNN generates a ukernel for each row count it meets, so every
  // decode batch size would otherwise pay for one on first use.
  const int64_t rows = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  // x's rows a cache line further apart than K: rows 2^n bytes apart alias in L1 as tiles load them
  const int64_t lda = K + 32;
  // x in bf16, in this thread's scratch (rounded or copied on this thread): zeroed when it
  // grows, then only the first M rows are written, so a padding row holds zeros or an earlier
  // call's x. Either way its output row, which depends on that row alone, is discarded; a
  // fresh zeroed tensor per call cost a fill of every padding row.
  thread_local std::vector<at::BFloat16> scratch;
  if (scratch.size() < static_cast<size_t>(rows * lda)) scratch.assign(rows * lda, at::BFloat16(0.f));
  at::BFloat16* ap = scratch.data();
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1) {
    const float* xp = x.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r) round_to_bf16(xp + r * x.stride(0), ap + r * lda, K);
  } else if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < M; ++r) std::memcpy(ap + r * lda, xp + r * x.stride(0), K * sizeof(at::BFloat16));
  } else {
    at::from_blob(ap, {rows, lda}, x.options().dtype(at::kBFloat16)).narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  const bool one_row = kHaveDot && M == 1;  // tiles_dot writes that row alone
  at::Tensor y = at::empty({one_row ? 1 : rows, N}, x.options().dtype(at::kFloat));
  const auto* bp = tiles.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  if (one_row)
    tiles_dot(ap, bp, tiles.size(0), K, N, yp);
  else if (kHaveAmx && rows >= 32 && K > 0 && K % 32 == 0 && tiles_amx_on.load(std::memory_order_relaxed) &&
           amx_permitted())
    tiles_amx(ap, lda, bp, tiles.size(0), rows, K, N, yp);
  else
    tiles_brgemm(ap, lda, bp, tiles.size(0), rows, K, N, yp);
  if (y.size(0) != M) y = y.narrow(0, 0, M);  // contiguous: the first M rows
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// Prefill rows are padded to a multiple of kPrefillRows for oneDNN's GEMM. oneDNN makes (JIT)
// a kernel for every new row count and weight shape, on that count's first call, and its
// primitive cache holds a bounded number of them (1,024 by default): a server's prompts of
// every length paid for new kernels again and again (docs/benchmarks.md). Padded, prefills
// of up to R rows make at most R / kPrefillRows kernels per weight shape; the zero rows cost
// at most kPrefillRows - 1 rows of work, and their outputs are dropped.
constexpr int64_t kPrefillRows = 16;  // an AMX tile's rows

at::Tensor prefill_mm(const at::Tensor& x, const at::Tensor& weight) {  // x [M, K] bf16 -> [M, N] bf16
  const int64_t M = x.size(0), padded = (M + kPrefillRows - 1) / kPrefillRows * kPrefillRows;
  if (padded == M) return at::mm(x, weight.t());
  at::Tensor xp = at::empty({padded, x.size(1)}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  xp.narrow(0, M, padded - M).zero_();
  return at::mm(xp, weight.t()).narrow(0, 0, M);  // the first M rows: contiguous
}

// y = x @ W.T for bf16 rows x and bfloat16 weights W, float32 sums rounded to bf16 (as a bf16
// model's activations are). Where `packed` holds W in the AMX tiles' layout (pack_tiles), up
// to kPackedMaxRows rows go through tiles_linear. Otherwise: up to kDotMaxRows rows through
// the vdpbf16ps kernel above where the CPU has AMX-era AVX512-BF16; more through oneDNN's bf16
// GEMM on AMX tiles, up to kPackedMaxRows from `packed`, W reordered once at load into
// oneDNN's blocked layout (a GEMM of decode rows otherwise reorders W on every call), beyond
// from W itself. What a compiled forward calls: the casts to and from bf16 stay in its graph,
// fused into the ops before and after, so no float32 copy of an activation is made for the
// GEMM alone.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.size(1) == weight.size(1),
              "bf16_gemm: bf16 x [M, K], bf16 weight [N, K]");
  const int64_t M = x.size(0);
  if (is_tiles(packed, weight) && M <= kPackedMaxRows)
    return tiles_linear(x, *packed, weight.size(0), c10::nullopt).to(at::kBFloat16);
  if (kHaveDot && M <= kDotMaxRows) return bf16_dot_linear(x, weight).to(at::kBFloat16);
  if (packed.has_value() && packed->defined() && M <= kPackedMaxRows) {
    static const auto linear_pointwise =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                              c10::string_view, c10::List<c10::optional<at::Scalar>>,
                              c10::optional<c10::string_view>)>();
    return linear_pointwise.call(x, *packed, c10::nullopt, "none", c10::List<c10::optional<at::Scalar>>(), "");
  }
  return prefill_mm(x, weight);
}

// y = x @ W.T (+ b) for float32 rows x and bfloat16 weights W, with x rounded to bf16 and
// float32 sums: bf16_gemm's routes, except that the tiles (up to kPackedMaxRows rows) and the
// dot kernel (up to kDotMaxRows) keep their float32 output unrounded; oneDNN's output is
// rounded to bf16 and widened. The bias is added in float32. The route for every row count on
// CPUs with AMX (modserve/plugins/platforms/cpu/features.py); a native decode step's linears.
at::Tensor bf16_gemm_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_gemm_linear: x [M, K], bf16 weight [N, K]");
  if (is_tiles(packed, weight) && x.size(0) <= kPackedMaxRows) return tiles_linear(x, *packed, weight.size(0), bias);
  at::Tensor y = kHaveDot && x.size(0) <= kDotMaxRows ? bf16_dot_linear(x, weight)
                                                       : bf16_gemm(x.to(at::kBFloat16), weight, packed).to(at::kFloat);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

bool bf16_dot_built() { return kHaveDot; }

}  // namespace

TORCH_LIBRARY(modserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor decode_weight, Tensor? packed_weight, Tensor? bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_gemm_linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor weight, Tensor? packed) -> Tensor");
  m.def("bf16_dot_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_dot_built() -> bool");
  m.def("tiles_ready() -> bool", [] { return tiles_ready(); });
  m.def("pack_tiles(Tensor weight) -> Tensor", TORCH_FN(pack_tiles));
  m.def("set_few_rows_floats(int floats) -> ()");
  m.def("few_rows_floats() -> int");
  m.def("few_rows_avx512_built() -> bool");
  m.def("set_tiles_amx(bool on) -> ()");
  // every backend, as few_rows_linear: a oneDNN-packed weight dispatches as MkldnnCPU
  m.impl("bf16_gemm_linear", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(bf16_gemm_linear));
  m.impl("bf16_gemm", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(bf16_gemm));
  m.impl("bf16_dot_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_dot_linear));
  m.impl("bf16_dot_built", c10::DispatchKey::CatchAll, TORCH_FN(bf16_dot_built));
  m.impl("set_few_rows_floats", c10::DispatchKey::CatchAll, TORCH_FN(set_few_rows_floats));
  m.impl("few_rows_floats", c10::DispatchKey::CatchAll, TORCH_FN(get_few_rows_floats));
  m.impl("few_rows_avx512_built", c10::DispatchKey::CatchAll, TORCH_FN(few_rows_avx512_built));
  m.impl("set_tiles_amx", c10::DispatchKey::CatchAll, TORCH_FN(set_tiles_amx));
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  m.impl("panel_linear", c10::DispatchKey::CPU, TORCH_FN(panel_linear));
  // every backend: a oneDNN-packed weight makes a call dispatch as MkldnnCPU, not CPU
  m.impl("few_rows_linear", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(few_rows_linear));
}
