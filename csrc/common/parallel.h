// Guided work distribution over the ATen thread pool: threads pull contiguous runs of items
// from a shared counter, the runs shrinking as the work runs out. A static split (what
// at::parallel_for does) makes a thread that the OS preempts (a web server, clients, the
// tokenizer sharing the cores) stall its partners at the barrier; pulling lets the others
// take over its remaining items, and contiguous runs keep each thread's memory streams long.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace punica_x {

// fn(i) for i < n; then, on every thread that ran items, done() once after its last item (where
// per-thread state an item set up, such as AMX tile configuration, is released).
template <typename F, typename Done>
void parallel_items(int64_t n, const F& fn, const Done& done) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    done();
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    bool ran = false;
    while (true) {
      int64_t begin = next.load(std::memory_order_relaxed);
      int64_t run = 0;
      do {
        if (begin >= n) break;
        run = std::max<int64_t>(1, (n - begin) / (2 * threads));
      } while (!next.compare_exchange_weak(begin, begin + run, std::memory_order_relaxed));
      if (begin >= n) break;
      ran = true;
      for (int64_t i = begin; i < std::min(n, begin + run); ++i) fn(i);
    }
    if (ran) done();
  });
}

template <typename F>
void parallel_items(int64_t n, const F& fn) {
  parallel_items(n, fn, [] {});
}

}  // namespace punica_x
