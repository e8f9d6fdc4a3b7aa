// The few-row CPU kernels' shared loop: a few rows of x against a weight matrix read once
// per pass (modserve_cpu::bf16_linear, modserve_int8::linear).

#pragma once

#include "claims.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace modserve {

// The few-row kernels' split: M rows of x in equal passes of at most `pass_rows` (12 rows
// with 8 a pass: 6 + 6), each pass reading the weights once; within a pass, the N output
// features are claimed four pieces a thread, of at least 64 features each. Calls
// f(first_row, rows, begin, end) for every piece.
template <class F>
void for_row_passes(int64_t M, int64_t N, int64_t pass_rows, const F& f) {
  if (M == 0) return;
  const int64_t passes = (M + pass_rows - 1) / pass_rows, per_pass = (M + passes - 1) / passes;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(64, (N + 4 * threads - 1) / (4 * threads));
  for (int64_t r = 0; r < M; r += per_pass) {
    const int64_t rows = std::min(per_pass, M - r);
    parallel_claims(N, grain, [&](int64_t begin, int64_t end) { f(r, rows, begin, end); });
  }
}

// f(std::integral_constant<int64_t, rows>{}) for rows in 1..8, so a kernel's row count is
// a template argument (its accumulators then stay in registers).
template <class F>
void with_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 7: f(std::integral_constant<int64_t, 7>{}); break;
    default: f(std::integral_constant<int64_t, 8>{}); break;
  }
}

// Accumulators per row of x that split K: one FMA chain runs at the FMA latency, below the
// memory bandwidth for one or two rows; with more rows, the rows' chains overlap.
constexpr int64_t accumulators(int64_t rows) { return rows == 1 ? 4 : rows <= 4 ? 2 : 1; }

}  // namespace modserve
