// Cache-line prefetches spread over a kernel's compute, a few lines per inner-loop step, so the
// requests overlap the arithmetic instead of stalling it (a burst of them waits on the few
// misses a core keeps in flight):
// - the bytes another kernel reads next: the dense GEMM of a projection, compute-bound at
//   decode batch sizes, pulls in the adapter weights the LoRA launch after it reads (scattered
//   over one region per adapter), while memory would otherwise idle;
// - a kernel's own next work item (Lookahead).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace punica_x {

// Regions as [n][2] int64: start address, bytes.
struct PrefetchSpans {
  const int64_t* spans = nullptr;
  int n = 0;

  int64_t lines() const {
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += span_lines(i);
    return total;
  }
  int64_t span_lines(int i) const {
    const int64_t start = spans[2 * i] & ~int64_t(63), end = spans[2 * i] + spans[2 * i + 1];
    return spans[2 * i + 1] > 0 ? (end - start + 63) / 64 : 0;
  }
};

// Lines to issue per inner-loop step so that `lines` spread over `steps` steps, at most
// kMaxLinesPerStep (a step cannot usefully ask for more, and an absurd hint, e.g. more than
// 2^31 lines, must not overflow the count: the lines past the last step are left unfetched).
constexpr int64_t kMaxLinesPerStep = 64;
inline int lines_per_step(int64_t lines, int64_t steps) {
  steps = std::max<int64_t>(steps, 1);
  return int(std::min<int64_t>((std::max<int64_t>(lines, 0) + steps - 1) / steps, kMaxLinesPerStep));
}


// Walks lines [first, first + count) of the spans' concatenation.
class PrefetchCursor {
 public:
  PrefetchCursor() = default;
  PrefetchCursor(const PrefetchSpans& s, int64_t first, int64_t count) : s_(&s), left_(count) {
    while (i_ < s.n && first >= s.span_lines(i_)) first -= s.span_lines(i_++);
    line_ = first;
    enter();
  }
  int64_t left() const { return left_; }

  // Lines [lines * p / parts, lines * (p + 1) / parts) of `lines` in all: part p of `parts`
  // (the work items of one kernel share the regions this way).
  static PrefetchCursor part(const PrefetchSpans& s, int64_t lines, int64_t p, int64_t parts) {
    const int64_t first = lines * p / parts;
    return PrefetchCursor(s, first, lines * (p + 1) / parts - first);
  }

  // Up to `count` more lines. Locality 2 (prefetcht1) is L2; 3 (prefetcht0) is L1 too.
  // Kernels call this from their inner loops: it must inline whole, with no call left in
  // it (every zmm / ymm register is caller-saved, and a call in the loop, even one never
  // taken, made GCC keep the SGMV shrink tile's accumulators in memory: 1.4-1.7x slower).
  template <int Locality = 2>
  __attribute__((always_inline)) inline void issue(int count) {
    runs(count, [](const char* p, int64_t n) __attribute__((always_inline)) {
      for (int64_t q = 0; q < n; ++q) __builtin_prefetch(p + 64 * q, 0, Locality);
    });
  }

  // Up to `count` more lines' addresses, in order, to `on_line`.
  template <typename F>
  inline void walk(int count, F&& on_line) {
    runs(count, [&](const char* p, int64_t n) {
      for (int64_t q = 0; q < n; ++q) on_line(p + 64 * q);
    });
  }

 private:
  // Up to `count` more lines as runs within one span: on_run(first line, lines). The cursor
  // is updated once per run, not per line (it lives in memory, so a per-line update is a
  // load and a store per prefetch: the one-row SGMV items ask for ~8 lines a step).
  template <typename F>
  __attribute__((always_inline)) inline void runs(int count, F&& on_run) {
    int64_t want = std::min<int64_t>(count, left_);
    if (want <= 0) return;
    left_ -= want;
    while (want > 0) {
      while (line_ >= lines_) ++i_, line_ = 0, enter();
      const int64_t run = std::min(want, lines_ - line_);
      on_run(base_ + 64 * line_, run);
      line_ += run;
      want -= run;
    }
  }

  __attribute__((always_inline)) void enter() {
    if (i_ >= s_->n) return;
    base_ = reinterpret_cast<const char*>(s_->spans[2 * i_] & ~int64_t(63));
    lines_ = s_->span_lines(i_);
  }

  const PrefetchSpans* s_ = nullptr;
  const char* base_ = nullptr;
  int i_ = 0;
  int64_t line_ = 0, lines_ = 0, left_ = 0;
};

// A compute loop with a hint issues its lines every kIssueEvery steps (kIssueEvery times its
// per-step count), outside its unrolled inner loop: walking the cursor on every step cost the
// dense GEMM 5-13% whatever the hint's size (its K loop lost its unrolling and stored the
// cursor back on every step; AMD EPYC Zen 4).
constexpr int kIssueEvery = 8;

// run(k0, k1) (the caller's unrolled loop over steps [k0, k1)) over steps [0, steps), with
// the hint's lines (pf_step a step) between runs of kIssueEvery steps while it lasts, then
// the rest in one run. PF false: one run, no hint.
template <bool PF, typename Run>
__attribute__((always_inline)) inline void hinted_steps(int steps, PrefetchCursor* pf, int pf_step, Run&& run) {
  int k0 = 0;
  if constexpr (PF) {
    for (; k0 < steps && pf->left() > 0; k0 += kIssueEvery) {
      pf->issue(kIssueEvery * pf_step);
      run(k0, std::min(steps, k0 + kIssueEvery));
    }
  }
  run(k0, steps);
}

// A kernel's next work item, prefetched over the current item's steps: SGMV's items read a few
// KB each from a different adapter, too short for the hardware prefetchers to ramp up on, and
// asking for all of it at once stalls on the few outstanding misses a core allows.
class Lookahead {
 public:
  // `rows` regions of `bytes`, `stride` bytes apart from `p`, over `steps` issue() calls.
  PrefetchCursor* plan(const void* p, int rows, int64_t stride, int64_t bytes, int steps) {
    spans_.resize(2 * size_t(rows));
    for (int q = 0; q < rows; ++q) {
      spans_[2 * q] = reinterpret_cast<int64_t>(p) + q * stride;
      spans_[2 * q + 1] = bytes;
    }
    regions_ = {spans_.data(), rows};
    const int64_t lines = regions_.lines();
    cursor_ = PrefetchCursor(regions_, 0, lines);
    step_ = lines_per_step(lines, steps);
    return &cursor_;
  }
  int step() const { return step_; }

 private:
  std::vector<int64_t> spans_;
  PrefetchSpans regions_;
  PrefetchCursor cursor_;
  int step_ = 0;
};

}  // namespace punica_x
