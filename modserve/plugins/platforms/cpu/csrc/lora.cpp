// LoRA adapters' updates added to one linear's output, all adapters and slices in one call,
// on the CPU (the LoRAKernel contract, modserve/core/contracts/lora.py).
//
// For each output slice i and each group g (a slot and its rows):
//   h = x[rows] @ A_i[slot, :r].T                  shrink, [n, r] in float32
//   y[rows, slice_i] += (h @ B_i[slot, :, :r].T) * scaling[g]   expand
// r is the adapter's rank: A and B are zero past it (padded to max_lora_rank), so the
// padded columns are skipped, not multiplied. Sums are float32 whatever the dtypes. B comes
// transposed, [L, R, out] (the caller keeps that copy): the expand then reads 16 output
// columns of one k as one vector, where B's own layout would need a transpose per block.
//
// The torch reference runs ~6 small ops per group and slice (gather, two mm, scale,
// scatter-add); a decode step of a 12-layer model with 4 adapters is over a thousand, each
// with its dispatch and Python. Here each linear is one op: the shrink split over the
// threads by (slice, 4 rows of a group), the expand by 16 output columns, both claimed
// as threads come free (claims.h). Vectors are 16 floats (GCC vector extensions): one
// zmm register where the build has AVX-512, two ymm (or four xmm) where it has not.
//
// Registered as torch.ops.modserve_lora.add (built by modserve/plugins/platforms/cpu/lora.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "claims.h"  // parallel_claims: modserve/api/csrc/, on every kernel's include path
#include "vec8.h"    // v16, load16, to_bf16

namespace {

using modserve::v16;
constexpr int64_t kLanes = 16;
constexpr int64_t kShrinkRows = 4;  // rows of x sharing each load of A's row
constexpr int64_t kExpandRows = 8;  // rows sharing each load of B's transposed row
constexpr int64_t kExpandClaim = 4;  // 16-column blocks a thread claims at a time

// Widening loads and rounding stores for the three float dtypes (bf16 and fp16 held as
// their 16-bit patterns); widening is exact.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(at::Half v) { return static_cast<float>(v); }

inline v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline v16 load16(const at::BFloat16* p) {  // a bf16 is the top half of a float32
  return modserve::load16(reinterpret_cast<const uint16_t*>(p));
}

inline v16 load16(const at::Half* p) {
  v16 r;
  for (int j = 0; j < kLanes; ++j) r[j] = static_cast<float>(p[j]);
  return r;
}

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) {  // rounded to nearest even, as torch rounds
  const uint16_t bits = modserve::to_bf16(v);
  std::memcpy(p, &bits, sizeof bits);
}
inline void store(at::Half* p, float v) { *p = static_cast<at::Half>(v); }

inline float hsum(v16 v) {  // a tree, not a chain
  modserve::v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return modserve::hsum(lo + hi);
}

// The step's groups: group g's rows are rows[first, first + count), all under `slot`.
struct Group {
  int64_t first, count, slot, rank;
  float scaling;
};

// h[m, k] = x[rows[m]] . a[k] for M <= kShrinkRows rows and k < rank; x rows of K values
// at x_stride, a [rank.., K]; h rows of R floats. Each row of A is read once for the M rows.
template <int64_t M, class X, class W>
void shrink_rows(const X* x, int64_t x_stride, const int64_t* rows, const W* a, int64_t K, int64_t rank,
                 float* h, int64_t R) {
  const X* xr[M];
  for (int64_t m = 0; m < M; ++m) xr[m] = x + rows[m] * x_stride;
  for (int64_t k = 0; k < rank; ++k) {
    const W* ak = a + k * K;
    v16 acc[M] = {};
    int64_t j = 0;
    for (; j + kLanes <= K; j += kLanes) {
      const v16 av = load16(ak + j);
      for (int64_t m = 0; m < M; ++m) acc[m] += load16(xr[m] + j) * av;
    }
    for (int64_t m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t t = j; t < K; ++t) s += widen(xr[m][t]) * widen(ak[t]);
      h[m * R + k] = s;
    }
  }
}

template <class X, class W>
void shrink_block(int64_t M, const X* x, int64_t x_stride, const int64_t* rows, const W* a, int64_t K, int64_t rank,
                  float* h, int64_t R) {
  switch (M) {
    case 1: shrink_rows<1>(x, x_stride, rows, a, K, rank, h, R); break;
    case 2: shrink_rows<2>(x, x_stride, rows, a, K, rank, h, R); break;
    case 3: shrink_rows<3>(x, x_stride, rows, a, K, rank, h, R); break;
    default: shrink_rows<4>(x, x_stride, rows, a, K, rank, h, R); break;
  }
}

// y[rows[m], y_col + c] += scaling * sum_k h[m, k] bt[k, c] for M rows and c < width <= 16,
// bt's rows `bt_stride` apart: per k one load of bt's row serves the M rows, whose sums are M
// independent FMA chains.
template <int64_t M, class X, class B>
void expand_rows(const float* h, int64_t R, const int64_t* rows, int64_t rank, float scaling, const B* bt,
                 int64_t bt_stride, int64_t width, X* y, int64_t y_stride, int64_t y_col) {
  v16 acc[M] = {};
  for (int64_t k = 0; k < rank; ++k) {
    const v16 bk = load16(bt + k * bt_stride);
    for (int64_t m = 0; m < M; ++m) acc[m] += h[m * R + k] * bk;
  }
  for (int64_t m = 0; m < M; ++m) {
    const v16 delta = acc[m] * scaling;
    X* yr = y + rows[m] * y_stride + y_col;
    if (std::is_same<X, float>::value && width == kLanes) {
      const v16 sum = load16(reinterpret_cast<const float*>(yr)) + delta;
      std::memcpy(yr, &sum, sizeof sum);
    } else {
      for (int64_t c = 0; c < width; ++c) store(yr + c, widen(yr[c]) + delta[c]);
    }
  }
}

template <class X, class B>
void expand_group(const float* h, int64_t R, const Group& g, const int64_t* rows, const B* bt, int64_t bt_stride,
                  int64_t width, X* y, int64_t y_stride, int64_t y_col) {
  for (int64_t m = 0; m < g.count; m += kExpandRows) {
    const float* hm = h + (g.first + m) * R;
    const int64_t* rm = rows + g.first + m;
    const auto run = [&](auto rows_now) {
      expand_rows<decltype(rows_now)::value>(hm, R, rm, g.rank, g.scaling, bt, bt_stride, width, y, y_stride, y_col);
    };
    switch (std::min(kExpandRows, g.count - m)) {
      case 1: run(std::integral_constant<int64_t, 1>()); break;
      case 2: run(std::integral_constant<int64_t, 2>()); break;
      case 3: run(std::integral_constant<int64_t, 3>()); break;
      case 4: run(std::integral_constant<int64_t, 4>()); break;
      case 5: run(std::integral_constant<int64_t, 5>()); break;
      case 6: run(std::integral_constant<int64_t, 6>()); break;
      case 7: run(std::integral_constant<int64_t, 7>()); break;
      default: run(std::integral_constant<int64_t, 8>()); break;
    }
  }
}

// One group's update of 16 output columns from o0 of a slice whose B^T is bt [rank.., out]: a
// full block read in place, a slice's last, narrower one copied into `tail` [rank, 16], zero
// past its width.
template <class X, class W>
void expand_block(const float* h, int64_t R, const Group& g, const int64_t* rows, const W* bt, int64_t out,
                  int64_t o0, X* y, int64_t y_stride, int64_t y_col, float* tail) {
  const int64_t width = std::min(kLanes, out - o0);
  if (width == kLanes) return expand_group(h, R, g, rows, bt + o0, out, width, y, y_stride, y_col);
  std::fill(tail, tail + g.rank * kLanes, 0.f);
  for (int64_t k = 0; k < g.rank; ++k)
    for (int64_t c = 0; c < width; ++c) tail[k * kLanes + c] = widen(bt[k * out + o0 + c]);
  expand_group(h, R, g, rows, static_cast<const float*>(tail), kLanes, width, y, y_stride, y_col);
}

template <class X, class W>
void lora_add_typed(at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList bt, const int64_t* rows,
                    const Group* groups, int64_t G, int64_t N, at::Tensor& scratch) {
  const int64_t S = a.size(), K = x.size(1), R = a[0].size(1);
  const X* xp = x.data_ptr<X>();
  X* yp = y.data_ptr<X>();
  float* h = scratch.data_ptr<float>();  // [S, N, R], then per thread a [R, 16] tail block of B^T
  float* tails = h + S * N * R;
  // Shrink: items (slice, group, block of kShrinkRows rows), numbered slice-major.
  int64_t blocks = 0;
  for (int64_t g = 0; g < G; ++g) blocks += (groups[g].count + kShrinkRows - 1) / kShrinkRows;
  modserve::parallel_claims(S * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / blocks;
      int64_t block = item % blocks, g = 0;
      for (int64_t n; block >= (n = (groups[g].count + kShrinkRows - 1) / kShrinkRows); block -= n) ++g;
      const Group& gr = groups[g];
      const int64_t m0 = block * kShrinkRows, M = std::min(kShrinkRows, gr.count - m0);
      const W* ai = a[i].data_ptr<W>() + gr.slot * R * K;
      shrink_block(M, xp, x.stride(0), rows + gr.first + m0, ai, K, gr.rank, h + (i * N + gr.first + m0) * R, R);
    }
  });
  // Expand: items of 16 output columns of one slice, every group's rows in each.
  int64_t col_blocks = 0;
  for (int64_t i = 0; i < S; ++i) col_blocks += (bt[i].size(2) + kLanes - 1) / kLanes;
  modserve::parallel_claims(col_blocks, kExpandClaim, [&](int64_t begin, int64_t end) {
    float* tail = tails + at::get_thread_num() * R * kLanes;
    for (int64_t item = begin; item < end; ++item) {
      int64_t i = 0, block = item, y_col = 0;
      for (int64_t n; block >= (n = (bt[i].size(2) + kLanes - 1) / kLanes); block -= n) y_col += bt[i++].size(2);
      const int64_t out = bt[i].size(2), o0 = block * kLanes;
      for (int64_t g = 0; g < G; ++g) {
        if (groups[g].rank == 0 || groups[g].count == 0) continue;  // y's rows stay as they are, bit for bit
        const W* bi = bt[i].data_ptr<W>() + groups[g].slot * R * out;
        expand_block(h + i * N * R, R, groups[g], rows, bi, out, o0, yp, y.stride(0), y_col + o0, tail);
      }
    }
  });
}

template <class X>
void lora_add_weights(at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList bt, const int64_t* rows,
                      const Group* groups, int64_t G, int64_t N, at::Tensor& scratch) {
  switch (a[0].scalar_type()) {
    case at::kFloat: return lora_add_typed<X, float>(y, x, a, bt, rows, groups, G, N, scratch);
    case at::kBFloat16: return lora_add_typed<X, at::BFloat16>(y, x, a, bt, rows, groups, G, N, scratch);
    case at::kHalf: return lora_add_typed<X, at::Half>(y, x, a, bt, rows, groups, G, N, scratch);
    default: TORCH_CHECK(false, "modserve_lora::add: A and B of dtype ", a[0].scalar_type());
  }
}

// y [T, sum(out_i)] += the groups' updates, in place. x [T, in]; a[i] [L, R, in] and
// bt[i] [L, R, out_i] (B transposed), contiguous, one dtype; rows [N] int64, the groups' rows
// back to back; groups [G, 4] int64 (first, count, slot, rank); scaling [G] float32.
void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList bt, const at::Tensor& rows,
              const at::Tensor& groups, const at::Tensor& scaling) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1 &&
                  x.scalar_type() == y.scalar_type(),
              "modserve_lora::add: x [T, in] and y [T, out] of one dtype, rows contiguous");
  TORCH_CHECK(!a.empty() && a.size() == bt.size(), "modserve_lora::add: one A and one B per slice");
  const int64_t T = x.size(0), K = x.size(1), L = a[0].size(0), R = a[0].size(1);
  int64_t outs = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].is_contiguous() && bt[i].is_contiguous() && a[i].scalar_type() == a[0].scalar_type() &&
                    bt[i].scalar_type() == a[0].scalar_type() && a[i].dim() == 3 && bt[i].dim() == 3 &&
                    a[i].size(0) == L && a[i].size(1) == R && a[i].size(2) == K && bt[i].size(0) == L &&
                    bt[i].size(1) == R,
                "modserve_lora::add: slice ", i, ": A [L, R, in] and B^T [L, R, out], contiguous, one dtype");
    outs += bt[i].size(2);
  }
  TORCH_CHECK(outs == y.size(1), "modserve_lora::add: the slices' outputs add up to ", outs, ", y has ", y.size(1));
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && groups.scalar_type() == at::kLong &&
                  groups.is_contiguous() && groups.dim() == 2 && groups.size(1) == 4 &&
                  scaling.scalar_type() == at::kFloat && scaling.numel() == groups.size(0),
              "modserve_lora::add: rows [N] int64, groups [G, 4] int64, scaling [G] float32");
  const int64_t G = groups.size(0), N = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* gp = groups.data_ptr<int64_t>();
  std::vector<Group> gs(G);  // a few entries
  for (int64_t g = 0; g < G; ++g) {
    gs[g] = {gp[4 * g], gp[4 * g + 1], gp[4 * g + 2], std::min(gp[4 * g + 3], R), scaling.data_ptr<float>()[g]};
    TORCH_CHECK(gs[g].first >= 0 && gs[g].count >= 0 && gs[g].first + gs[g].count <= N && gs[g].slot >= 0 &&
                    gs[g].slot < L && gs[g].rank >= 0,
                "modserve_lora::add: group ", g, " out of range");
  }
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(rp[n] >= 0 && rp[n] < T, "modserve_lora::add: row ", rp[n], " of ", T);
  if (N == 0 || R == 0) return;
  at::Tensor scratch = at::empty({static_cast<int64_t>(a.size()) * N * R + at::get_num_threads() * R * kLanes},
                                 x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: return lora_add_weights<float>(y, x, a, bt, rp, gs.data(), G, N, scratch);
    case at::kBFloat16: return lora_add_weights<at::BFloat16>(y, x, a, bt, rp, gs.data(), G, N, scratch);
    case at::kHalf: return lora_add_weights<at::Half>(y, x, a, bt, rp, gs.data(), G, N, scratch);
    default: TORCH_CHECK(false, "modserve_lora::add: activations of dtype ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(modserve_lora, m) {
  m.def("add(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor rows, Tensor groups, Tensor scaling) -> ()");
  m.impl("add", c10::DispatchKey::CPU, TORCH_FN(lora_add));
}
