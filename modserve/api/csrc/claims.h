// Work handed to threads as they ask for it, for the C++ CPU kernels.
//
// at::parallel_for splits a range into one equal part per thread, fixed in advance, so
// a kernel ends when its slowest thread does. Here that thread is often not slower by its
// work but by its core: on a shared 2-core machine the other processes (and this one's
// own Python, between ops) take one core for a while, and the other thread then spun at
// the barrier for ~20% of a workload's time. Claimed in small pieces, the work goes to
// whichever thread is running. Each item is computed exactly as before, by one thread,
// so results do not depend on who took it.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace modserve {

// f(begin, end) for consecutive pieces of [0, n), `grain` items each (the last may be
// shorter), every piece run once by whichever thread claims it next.
template <class F>
void parallel_claims(int64_t n, int64_t grain, const F& f) {
  const int64_t pieces = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pieces);
  std::atomic<int64_t> next{0};
  auto claim_until_done = [&] {
    for (int64_t b; (b = next.fetch_add(grain, std::memory_order_relaxed)) < n;) f(b, std::min(n, b + grain));
  };
  if (threads <= 1 || at::in_parallel_region()) {
    claim_until_done();
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { claim_until_done(); });
}

}  // namespace modserve
