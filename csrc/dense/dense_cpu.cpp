// Skinny-to-square GEMM for the backbone's projections on the CPU.
//
// MKL's unpacked sgemm re-packs W on every call, which dominates for the 8..64-row matrices of
// decode steps. With W packed once at load, an MB-row x 3-vector register tile streams each
// panel once from memory and reuses it from L2 for every row block. The tile is sized to the
// register file: 8 x 48 (24 accumulators of 32 zmm) on AVX-512, 4 x 24 (12 of 16 ymm) on AVX2;
// bf16 on the avx512_bf16 build multiplies K pairs with vdpbf16ps (tile_dot);
// the AVX-512 tile compiled for AVX2 needs ~56 registers and spills on every FMA (6 GFLOP/s
// instead of ~150 at M = 32).
// A panel is read in address order, which the hardware's stream prefetchers follow: the tiles
// issue no prefetch of their own. They used to ask for the panel 16 rows ahead; without that
// the GEMM alone took 0.89x at 1 row and 0.96x at 32 (SmolLM2's shapes, cold weights, bf16 on
// avx512_bf16; 0.87-0.98x on the avx512 build, 0.94-1.02x on avx2), and a Distinct step's
// GEMM, which also carries the next LoRA launch's hint, ~1.2 ms less (AMD EPYC Zen 4,
// 2026-11-26): the tiles' own prefetches took the miss buffers the hint needs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/parallel.h"
#include "../common/prefetch.h"
#include "../common/simd.h"
#include "dense.h"

namespace punica_x {
namespace {

using namespace simd;
constexpr int kNB = kDenseVecs;
// Rows per tile: accumulators + the panel row + one broadcast must fit the registers.
#ifndef PUNICA_X_DENSE_MB
#define PUNICA_X_DENSE_MB (kVecRegs == 32 ? 8 : 4)
#endif
constexpr int kMB = PUNICA_X_DENSE_MB;
static_assert(kMB * kNB + kNB + 1 <= kVecRegs, "dense tile does not fit the vector registers");

// x float32 (a bf16 x is widened once per call, see dense_gemm_cpu), W of TW (float or bf16),
// y of TY; float32 accumulators started from the panel's bias (float32, zero past the last
// column; null for none), y rounded once.
template <typename TW, typename TY, int MB, bool PF>
void tile(const float* x, int64_t xs, const TW* w, int k, const float* bias, TY* y, int64_t ys,
          PrefetchCursor* pf, int pf_step) {
  vf acc[MB][kNB] = {};
  if (bias)
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < kNB; ++n) acc[m][n] = load(bias + n * kLanes);
  auto step = [&](int kk) {
    vf wv[kNB];
    for (int n = 0; n < kNB; ++n) wv[n] = load(w + kk * kDensePanel + n * kLanes);
    for (int m = 0; m < MB; ++m) {
      const vf xv = splat(x[m * xs + kk]);
      for (int n = 0; n < kNB; ++n) acc[m][n] = fmadd(xv, wv[n], acc[m][n]);
    }
  };
  hinted_steps<PF>(k, pf, pf_step, [&](int k0, int k1) {
#pragma GCC unroll 4
    for (int kk = k0; kk < k1; ++kk) step(kk);
  });
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < kNB; ++n) store(y + m * ys + n * kLanes, acc[m][n]);
}

template <typename TW, typename TY>
using TileFn = void (*)(const float*, int64_t, const TW*, int, const float*, TY*, int64_t,
                        PrefetchCursor*, int);

template <typename TW, typename TY, bool PF, int... M>
constexpr std::array<TileFn<TW, TY>, sizeof...(M)> tiles(std::integer_sequence<int, M...>) {
  return {&tile<TW, TY, M + 1, PF>...};
}

// [with a prefetch hint][rows - 1]: the tiles without one are the plain loop
template <typename TW, typename TY>
const std::array<std::array<TileFn<TW, TY>, kMB>, 2> kTiles = {
    tiles<TW, TY, false>(std::make_integer_sequence<int, kMB>{}),
    tiles<TW, TY, true>(std::make_integer_sequence<int, kMB>{})};

#if defined(__AVX512BF16__)
// The avx512_bf16 build's bf16 tile: x stays bf16 (a K pair of a row broadcast as one 32-bit
// lane), W packed in K pairs ([K/2][kDensePanel][2]), vdpbf16ps adds both products of a pair
// into the float32 accumulator: per panel row pair, kNB loads and MB x kNB instructions for
// 2 x MB x kDensePanel multiply-adds, twice the fp32 tile's work per instruction.
template <typename TY, int MB, bool PF>
void tile_dot(const bf16* x, int64_t xs, const bf16* w, int k, const float* bias, TY* y, int64_t ys,
              PrefetchCursor* pf, int pf_step) {
  constexpr int kRow = 2 * kDensePanel;  // bf16 values in one packed row (a K pair)
  vf acc[MB][kNB] = {};
  if (bias)
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < kNB; ++n) acc[m][n] = load(bias + n * kLanes);
  const int pairs = k / 2;
  auto step = [&](int kk, auto splat_x) {
    vbh wv[kNB];
    for (int n = 0; n < kNB; ++n) wv[n] = load_pairs(w + int64_t(kk) * kRow + n * 2 * kLanes);
    for (int m = 0; m < MB; ++m) {
      const vbh xv = splat_x(x + m * xs + 2 * kk);
      for (int n = 0; n < kNB; ++n) acc[m][n] = dot_pairs(acc[m][n], xv, wv[n]);
    }
  };
  auto pair_step = [&](int kk) { step(kk, [](const bf16* p) { return splat_pair(p); }); };
  hinted_steps<PF>(pairs, pf, pf_step, [&](int k0, int k1) {
#pragma GCC unroll 2
    for (int kk = k0; kk < k1; ++kk) pair_step(kk);
  });
  if (k & 1) step(pairs, [](const bf16* p) { return splat_pair(p, false); });
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < kNB; ++n) store(y + m * ys + n * kLanes, acc[m][n]);
}

using DotFn = void (*)(const bf16*, int64_t, const bf16*, int, const float*, bf16*, int64_t,
                       PrefetchCursor*, int);

template <bool PF, int... M>
constexpr std::array<DotFn, sizeof...(M)> dot_tiles(std::integer_sequence<int, M...>) {
  return {&tile_dot<bf16, M + 1, PF>...};
}

const std::array<std::array<DotFn, kMB>, 2> kDotTiles = {
    dot_tiles<false>(std::make_integer_sequence<int, kMB>{}),
    dot_tiles<true>(std::make_integer_sequence<int, kMB>{})};
#endif

// dst[0:n] = src[0:n] widened to float32.
void widen(float* dst, const bf16* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = f32(src[i]);
}

// The rows of one panel through the tiles of `table` (x of TX, W of TW: the packed panel
// itself, or its float32 copy).
template <typename T, typename TX, typename TW, typename Table>
void panel_rows(const Table& table, T* y, int64_t ys, const TX* x, int64_t xs, const TW* w, const float* bias,
                int m, int k, int c0, int cols, PrefetchCursor* pf) {
  alignas(64) T edge[kMB * kDensePanel];  // the last, partial panel goes through here
  // the item's prefetch lines spread evenly over every K step of every row block
  const int64_t steps = int64_t((m + kMB - 1) / kMB) * std::max(1, k / kDenseKPack<TW>);
  const int pf_step = pf && pf->left() ? lines_per_step(pf->left(), steps) : 0;
  for (int m0 = 0; m0 < m; m0 += kMB) {
    const int mb = std::min(kMB, m - m0);
    T* out = cols == kDensePanel ? y + m0 * ys + c0 : edge;
    const int64_t os = cols == kDensePanel ? ys : kDensePanel;
    table[pf_step ? 1 : 0][mb - 1](x + m0 * xs, xs, w, k, bias, out, os, pf, pf_step);
    if (cols < kDensePanel)
      for (int r = 0; r < mb; ++r)
        std::copy(edge + r * kDensePanel, edge + r * kDensePanel + cols, y + (m0 + r) * ys + c0);
  }
}

}  // namespace

template <typename T>
void dense_pack_cpu(T* packed, const T* w, int64_t ws, int k, int n, bool w_is_out_by_in) {
  constexpr int kp = kDenseKPack<T>;
  const int panels = (n + kDensePanel - 1) / kDensePanel;
  const int64_t rows = dense_packed_rows<T>(k);
  parallel_items(panels, [&](int64_t p) {
    for (int kk = 0; kk < rows * kp; ++kk)
      for (int c = 0; c < kDensePanel; ++c) {
        const int col = int(p) * kDensePanel + c;
        T v = narrow<T>(0.f);
        if (col < n && kk < k) v = w_is_out_by_in ? w[col * ws + kk] : w[kk * ws + col];
        packed[((p * rows + kk / kp) * kDensePanel + c) * kp + kk % kp] = v;
      }
  });
}

// bf16 on the avx512_bf16 build: x and the K-pair panels go straight into vdpbf16ps.
// bf16 elsewhere: x is widened to float32 once per call, and when more than one block of rows
// reads a panel, the panel is widened once into a per-thread float32 copy (L2-resident) that
// every row block reads, so the conversions cost per weight, not per weight x row block.
// Memory still streams the 2-byte panel. One row block (a small decode batch) reads the bf16
// panel directly.
template <typename T>
void dense_gemm_cpu(T* y, int64_t ys, const T* x, int64_t xs, const T* packed, const T* bias, int m, int k,
                    int n, const PrefetchSpans& prefetch) {
  const int64_t pf_lines = prefetch.lines();
  const int panels = (n + kDensePanel - 1) / kDensePanel;
  const int64_t panel_size = dense_packed_rows<T>(k) * kDensePanel * kDenseKPack<T>;
  const float* xf = nullptr;
  int64_t xfs = 0;
  std::vector<float> x32;
  if constexpr (std::is_same_v<T, float>) {
    xf = x, xfs = xs;
  } else if constexpr (!kBf16Dot) {
    x32.resize(size_t(m) * k);
    for (int r = 0; r < m; ++r) widen(x32.data() + int64_t(r) * k, x + r * xs, k);
    xf = x32.data(), xfs = k;
  }
  parallel_items(panels, [&](int64_t p) {
    const T* w = packed + p * panel_size;
    const int c0 = int(p) * kDensePanel;
    const int cols = std::min(kDensePanel, n - c0);
    alignas(64) float panel_bias[kDensePanel] = {};
    for (int c = 0; bias && c < cols; ++c) panel_bias[c] = f32(bias[c0 + c]);
    const float* b = bias ? panel_bias : nullptr;
    PrefetchCursor cursor = PrefetchCursor::part(prefetch, pf_lines, p, panels);  // this panel's share
    PrefetchCursor* pf = cursor.left() ? &cursor : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      panel_rows(kTiles<float, float>, y, ys, xf, xfs, w, b, m, k, c0, cols, pf);
    } else if constexpr (kBf16Dot) {
#if defined(__AVX512BF16__)
      panel_rows(kDotTiles, y, ys, x, xs, w, b, m, k, c0, cols, pf);
#endif
    } else if (m <= kMB) {
      panel_rows(kTiles<T, T>, y, ys, xf, xfs, w, b, m, k, c0, cols, pf);
    } else {
      thread_local std::vector<float> wide;
      wide.resize(size_t(k) * kDensePanel);
      widen(wide.data(), w, int64_t(k) * kDensePanel);
      panel_rows(kTiles<float, T>, y, ys, xf, xfs, wide.data(), b, m, k, c0, cols, pf);
    }
  });
}

template void dense_pack_cpu<float>(float*, const float*, int64_t, int, int, bool);
template void dense_pack_cpu<simd::bf16>(simd::bf16*, const simd::bf16*, int64_t, int, int, bool);
template void dense_gemm_cpu<float>(float*, int64_t, const float*, int64_t, const float*, const float*, int,
                                    int, int, const PrefetchSpans&);
template void dense_gemm_cpu<simd::bf16>(simd::bf16*, int64_t, const simd::bf16*, int64_t, const simd::bf16*,
                                         const simd::bf16*, int, int, int, const PrefetchSpans&);

}  // namespace punica_x
