// CPU SGMV: register-tiled kernels on hardware vectors (simd.h: 16 floats on AVX-512, 8 on
// AVX2), work split over (segment, tile) items on the ATen thread pool. Tile sizes follow the
// register file (32 zmm / 16 ymm) so no tile spills; static_asserts below check it. float x
// may read bf16 weights (widened as loaded: half the bytes of a memory-bound launch).
//
// shrink: a tile is MB rows x JB rank rows of A^T; it streams JB rows of A^T once and reuses each
//         loaded vector for MB input rows. bf16 on the avx512_bf16 build: vdpbf16ps on x and A
//         as stored (both run along h_in, so K pairs need no repacking). One-row segments (the distinct case) take JB = 8 so
//         each item keeps eight independent memory streams in flight.
// expand: a tile is MB rows x NB vectors of output columns; it streams the rank rows of B once
//         per row block. One-row segments take wide column blocks for long sequential reads.
//         bf16 on the avx512_bf16 build, segments of several rows: vdpbf16ps on two rank rows
//         at a time (expand_dot.h), except in fixed order (sgmv.h), where every segment keeps
//         the widening tiles.
// Prefetch: an item fetches its successor's weights over its own inner steps when the
// successor is the first to read them (common/prefetch.h: Lookahead; a burst of them at the
// item's start, as before, stalled on the few misses a core keeps in flight: the distinct
// launch from memory took 0.76x the time): every expand item (each reads its own B block),
// and the shrink items of a segment's first row block (the later row blocks read the same A
// rows from cache). Segments of several rows gained it on 2026-11-26: the LoRA part of a
// step of 6 adapters behind the dense GEMM 0.90-0.92x, of one adapter 0.90-0.96x (Zen 4,
// avx512_bf16, shuffled-order runs). The dense GEMM before a launch also pulls in one-row
// segments' weights while it computes (LoraLinear, SgmvWeights.prefetch_spans); for segments
// of several rows that hint cost the GEMM more than it saved. bf16 segments of several rows
// may run on AMX tiles instead (amx.h; off unless asked for).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/parallel.h"
#include "../common/prefetch.h"
#include "../common/simd.h"
#include "amx.h"
#include "expand_dot.h"
#include "sgmv.h"

namespace punica_x {
namespace {

using namespace simd;

// v[m, j] = dot(x[m, :], a[j, :]) for m < MB, j < JB; a rows are h_in long. T (x) and W (a):
// float or bf16 (T float with W bf16: weights stored in bf16, widened as loaded), v float32.
template <typename T, typename W, int MB, int JB>
void shrink_tile(const T* x, int64_t xs, const W* a, int h_in, float* v, int64_t vs, PrefetchCursor* pf,
                 int pf_step) {
  vf acc[MB][JB] = {};
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<W, bf16>) {  // both K-contiguous: pairs as stored
    auto step = [&](int k, auto load_k) {
      if (pf) pf->issue(pf_step);
      vbh av[JB];
      for (int j = 0; j < JB; ++j) av[j] = load_k(a + int64_t(j) * h_in + k);
      for (int m = 0; m < MB; ++m) {
        const vbh xv = load_k(x + m * xs + k);
        for (int j = 0; j < JB; ++j) acc[m][j] = dot_pairs(acc[m][j], xv, av[j]);
      }
    };
    int k = 0;
    for (; k + 2 * kLanes <= h_in; k += 2 * kLanes) step(k, [](const bf16* p) { return load_pairs(p); });
    if (k < h_in) step(k, [n = h_in - k](const bf16* p) { return load_pairs(p, n); });
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < JB; ++j) v[m * vs + j] = hsum(acc[m][j]);
    return;
  }
#endif
  int k = 0;
  for (; k + kLanes <= h_in; k += kLanes) {
    if (pf) pf->issue(pf_step);
    vf av[JB];
    for (int j = 0; j < JB; ++j) av[j] = load(a + int64_t(j) * h_in + k);
    for (int m = 0; m < MB; ++m) {
      const vf xv = load(x + m * xs + k);
      for (int j = 0; j < JB; ++j) acc[m][j] = fmadd(xv, av[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < JB; ++j) {
      float s = hsum(acc[m][j]);
      for (int kk = k; kk < h_in; ++kk) s = std::fma(f32(x[m * xs + kk]), f32(a[int64_t(j) * h_in + kk]), s);
      v[m * vs + j] = s;
    }
  }
}

// y[m, c] += sum_i v[m, i] * b[i, c] for m < MB, c < NB * kLanes; b rows are `ld` long.
// T (y; rounded once, after the whole sum) and W (b): float or bf16, v float32.
template <typename T, typename W, int MB, int NB>
void expand_tile(const float* v, int64_t vs, int r, const W* b, int64_t ld, T* y, int64_t ys,
                 PrefetchCursor* pf, int pf_step) {
  vf acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = load(y + m * ys + n * kLanes);
  for (int i = 0; i < r; ++i) {
    if (pf) pf->issue(pf_step);
    vf bv[NB];
    for (int n = 0; n < NB; ++n) bv[n] = load(b + i * ld + n * kLanes);
    for (int m = 0; m < MB; ++m) {
      const vf s = splat(v[m * vs + i]);
      for (int n = 0; n < NB; ++n) acc[m][n] = fmadd(s, bv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) store(y + m * ys + n * kLanes, acc[m][n]);
}

// Scalar columns left over when h_out is not a multiple of kLanes.
template <typename T, typename W>
void expand_cols_scalar(const float* v, int64_t vs, int rows, int r, const W* b, int64_t ld,
                        int cols, T* y, int64_t ys) {
  for (int m = 0; m < rows; ++m)
    for (int c = 0; c < cols; ++c) {
      float s = 0.f;
      for (int i = 0; i < r; ++i) s = std::fma(v[m * vs + i], f32(b[i * ld + c]), s);
      y[m * ys + c] = narrow<T>(f32(y[m * ys + c]) + s);
    }
}

template <typename T, typename W>
using ShrinkFn = void (*)(const T*, int64_t, const W*, int, float*, int64_t, PrefetchCursor*, int);
template <typename T, typename W>
using ExpandFn = void (*)(const float*, int64_t, int, const W*, int64_t, T*, int64_t, PrefetchCursor*, int);

template <typename T, typename W, int MB, int... J>
constexpr std::array<ShrinkFn<T, W>, sizeof...(J)> shrink_row(std::integer_sequence<int, J...>) {
  return {&shrink_tile<T, W, MB, J + 1>...};
}

template <typename T, typename W, int MB, int... N>
constexpr std::array<ExpandFn<T, W>, sizeof...(N)> expand_row(std::integer_sequence<int, N...>) {
  return {&expand_tile<T, W, MB, N + 1>...};
}

// Multi-row tiles are MB rows x JB (shrink) or NB (expand) vectors: 4 x 4 of AVX-512's 32
// registers, 6 x 2 of AVX2's 16 (12 accumulators; 4 x 2 measured ~1.5x slower there).
constexpr bool kWide = kVecRegs >= 32;
#ifndef PUNICA_X_SGMV_MB
#define PUNICA_X_SGMV_MB (kWide ? 4 : 6)
#endif
constexpr int kMB = PUNICA_X_SGMV_MB;
constexpr int kShrinkMaxJB = 8;                 // one-row tiles: 8 accumulators
constexpr int kShrinkJB = kWide ? 4 : 2;        // multi-row tiles: MB x JB accumulators
constexpr int kExpandNarrowNB = kWide ? 4 : 2;  // multi-row tiles: MB x NB accumulators
constexpr int kExpandWideNB = kWide ? 16 : 12;  // one-row tiles: 1 x NB (B read from memory)
// accumulators + the loaded weight vectors + one input vector must fit the registers
static_assert(kMB * kShrinkJB + kShrinkJB + 1 <= kVecRegs, "shrink tile spills");
static_assert(kShrinkMaxJB + 1 <= kVecRegs, "one-row shrink tile spills");  // A read from memory
static_assert(kMB * kExpandNarrowNB + kExpandNarrowNB + 1 <= kVecRegs, "expand tile spills");
static_assert(kExpandWideNB + 1 <= kVecRegs, "one-row expand tile spills");
#if defined(__AVX512BF16__)
static_assert(kLanes * kExpandNarrowNB == 32 * expand_dot::kNarrowUnits,
              "the bf16 expand tiles cover the multi-row items' columns");
#endif

template <typename T, typename W, int... M>
constexpr auto shrink_table(std::integer_sequence<int, M...>) {
  using Seq = std::make_integer_sequence<int, kShrinkMaxJB>;
  return std::array<std::array<ShrinkFn<T, W>, kShrinkMaxJB>, sizeof...(M)>{
      shrink_row<T, W, M + 1>(Seq{})...};
}

template <typename T, typename W, int... M>
constexpr auto expand_table(std::integer_sequence<int, M...>) {
  using Seq = std::make_integer_sequence<int, kExpandNarrowNB>;
  return std::array<std::array<ExpandFn<T, W>, kExpandNarrowNB>, sizeof...(M)>{
      expand_row<T, W, M + 1>(Seq{})...};
}

template <typename T, typename W>
ShrinkFn<T, W> shrink_kernel(int mb, int jb) {
  static const auto table = shrink_table<T, W>(std::make_integer_sequence<int, kMB>{});
  return table[mb - 1][jb - 1];
}

// bf16 segments of several rows run expand_dot.h's tiles on the avx512_bf16 build; bf16 x
// comes with bf16 weights only (sgmv.h), so T bf16 says both are
template <typename T>
constexpr bool kDotExpand = std::is_same_v<T, bf16> && kBf16Dot;
// the (x, weights) pairs the kernels take: both float, both bf16, or float x with bf16 weights
template <typename T, typename W>
constexpr bool kPair = std::is_same_v<T, W> || (std::is_same_v<T, float> && std::is_same_v<W, bf16>);

template <typename T, typename W>
ExpandFn<T, W> expand_kernel(int mb, int nb) {
  static const std::array<ExpandFn<T, W>, kExpandWideNB> wide =
      expand_row<T, W, 1>(std::make_integer_sequence<int, kExpandWideNB>{});
  if (mb == 1) return wide[nb - 1];
  // bf16 on the avx512_bf16 build: only in fixed order (else expand_dot takes these rows)
  static const auto narrow_tiles = expand_table<T, W>(std::make_integer_sequence<int, kMB>{});
  return narrow_tiles[mb - 1][nb - 1];
}

struct ShrinkItem {
  int seg, row0, rows, j0, jn;
  bool tiles;  // on AMX tiles (amx.h): all rows of the segment, up to 64 rank rows
};

struct ExpandItem {
  int seg, slice, c0, cn;
  int64_t pairs;  // where v's bf16 pairs (expand_dot.h) start in the launch's buffer; -1: none
  bool tiles;     // on AMX tiles (amx.h): v split in chunks (amx::split_chunks) at `pairs`
};

constexpr int kTileWidth = 64;  // rank rows of a tiles shrink item, columns of an expand item

int rank_sum(const SgmvSegments& p, int s) {
  int r = 0;
  for (int j = 0; j < p.num_slices; ++j) r += p.ranks[s * p.num_slices + j];
  return r;
}

}  // namespace

template <typename T, typename W>
void sgmv_shrink_cpu(float* v, int64_t v_stride, const T* x, int64_t x_stride, int h_in,
                     const SgmvSegments& p) {
  static_assert(kPair<T, W>, "bf16 x comes with bf16 weights only");
  std::vector<ShrinkItem> items;
  const int tile_mode = amx::tiles_mode<T>();  // read once: a launch's items agree on it
  for (int s = 0; s < p.num_segments; ++s) {
    const int rows = p.seg[s + 1] - p.seg[s];
    const int rank = rank_sum(p, s);
    if (p.w_ptr[s] == 0 || rows == 0 || rank == 0) continue;
    if (!p.fixed_order && amx::on_tiles(tile_mode, rows, h_in)) {
      for (int j0 = 0; j0 < rank; j0 += kTileWidth)
        items.push_back({s, p.seg[s], rows, j0, std::min(kTileWidth, rank - j0), true});
      continue;
    }
    const int jb = rows == 1 ? kShrinkMaxJB : kShrinkJB;
    for (int r0 = 0; r0 < rows; r0 += kMB)
      for (int j0 = 0; j0 < rank; j0 += jb)
        items.push_back({s, p.seg[s] + r0, std::min(kMB, rows - r0), j0, std::min(jb, rank - j0), false});
  }
  auto weights = [&](const ShrinkItem& it) {  // the item's jn rows of A^T, contiguous
    return reinterpret_cast<const W*>(p.w_ptr[it.seg]) +
           (int64_t(p.layer) * rank_sum(p, it.seg) + it.j0) * h_in;
  };
  const int64_t n = int64_t(items.size());
  constexpr int kShrinkK = std::is_same_v<T, bf16> && kBf16Dot ? 2 * kLanes : kLanes;
  const int k_steps = (h_in + kShrinkK - 1) / kShrinkK;
  const int64_t phase = amx::phase_for(tile_mode);
  // an item in the first row block of its segment is the first to read its A rows
  auto first_read = [&](const ShrinkItem& it) { return it.row0 == p.seg[it.seg]; };
  parallel_items(n, [&](int64_t i) {
    const ShrinkItem& it = items[i];
#if defined(PUNICA_X_AMX)
    if constexpr (std::is_same_v<T, bf16>) {
      if (it.tiles) {
        amx::with_tiles(tile_mode, [&](auto tiles) {
          amx::shrink<decltype(tiles)>(phase, v + it.row0 * v_stride + it.j0, v_stride,
                                       x + it.row0 * x_stride, x_stride, it.rows, weights(it), it.jn, h_in);
        });
        return;
      }
    }
#endif
    thread_local Lookahead ahead;  // a successor's A rows, over this item's K steps
    PrefetchCursor* pf = nullptr;
    if (i + 1 < n && first_read(items[i + 1]))
      pf = ahead.plan(weights(items[i + 1]), 1, 0, int64_t(items[i + 1].jn) * h_in * sizeof(W), k_steps);
    shrink_kernel<T, W>(it.rows, it.jn)(x + it.row0 * x_stride, x_stride, weights(it), h_in,
                                     v + it.row0 * v_stride + it.j0, v_stride, pf, pf ? ahead.step() : 0);
  }, [&] { amx::end_phase(tile_mode, phase); });
}

template <typename T, typename W>
void sgmv_expand_cpu(T* y, int64_t y_stride, const float* v, int64_t v_stride,
                     const int32_t* h_out, const SgmvSegments& p) {
  static_assert(kPair<T, W>, "bf16 x comes with bf16 weights only");
  std::vector<ExpandItem> items;
  int64_t pair_elems = 0;  // bf16 elements of every dot item's v pairs
  const int tile_mode = amx::tiles_mode<T>();
  for (int s = 0; s < p.num_segments; ++s) {
    const int rows = p.seg[s + 1] - p.seg[s];
    if (p.w_ptr[s] == 0 || rows == 0) continue;
    const bool tiles = !p.fixed_order && amx::on_tiles(tile_mode, rows, 0);
    // bf16 dot tiles (avx512_bf16): segments of several rows, except in fixed order, where
    // every segment takes the widening tiles, a one-row segment's arithmetic
    const bool dot = kDotExpand<T> && rows > 1 && !p.fixed_order && !tiles;
    const int width = tiles ? kTileWidth : kLanes * (rows == 1 ? kExpandWideNB : kExpandNarrowNB);
    for (int j = 0; j < p.num_slices; ++j) {
      const int r = p.ranks[s * p.num_slices + j];
      if (r == 0) continue;
      int64_t pairs = -1;
#if defined(PUNICA_X_AMX)
      if (tiles) {
        pairs = pair_elems;
        pair_elems += int64_t(rows) * amx::chunks(r) * 32;
      }
#endif
#if defined(__AVX512BF16__)
      // several rows: two rank rows per vdpbf16ps; one row reads B from memory, where the
      // widening tile measured faster (1.06x warm, 1.03x cold for the dot tile)
      if (dot) {
        pairs = pair_elems;
        pair_elems += int64_t(rows) * expand_dot::pair_stride(r);
      }
#endif
      for (int c0 = 0; c0 < h_out[j]; c0 += width)
        items.push_back({s, j, c0, std::min(width, h_out[j] - c0), pairs, tiles});
    }
  }
  struct Place {  // where an item reads B and v and writes y
    const W* b;
    int64_t v_off, y_off;
  };
  auto place = [&](const ExpandItem& it) {
    const int32_t* ranks = p.ranks + it.seg * p.num_slices;
    int64_t layer_size = 0, b_off = 0, v_off = 0, y_off = 0;
    for (int j = 0; j < p.num_slices; ++j) {
      if (j < it.slice) {
        b_off += int64_t(ranks[j]) * h_out[j];
        v_off += ranks[j];
        y_off += h_out[j];
      }
      layer_size += int64_t(ranks[j]) * h_out[j];
    }
    const W* b = reinterpret_cast<const W*>(p.w_ptr[it.seg]) + p.layer * layer_size + b_off + it.c0;
    return Place{b, v_off, y_off};
  };
  const bf16* pair_base = nullptr;
#if defined(__AVX512BF16__)
  // v split once per (segment, slice) here, not per column item (a segment's items are
  // consecutive); the calling thread's buffer, reused across launches
  thread_local std::vector<bf16> pair_buf;
  if (pair_elems > 0) {
    if (int64_t(pair_buf.size()) < pair_elems) pair_buf.resize(pair_elems);
    for (size_t i = 0; i < items.size(); ++i) {
      const ExpandItem& it = items[i];
      if (it.pairs < 0 || (i > 0 && items[i - 1].pairs == it.pairs)) continue;
      const int row0 = p.seg[it.seg], rows = p.seg[it.seg + 1] - row0;
      const float* vrows = v + row0 * v_stride + place(it).v_off;
      const int r = p.ranks[it.seg * p.num_slices + it.slice];
#if defined(PUNICA_X_AMX)
      if (it.tiles) {
        amx::split_chunks(pair_buf.data() + it.pairs, vrows, v_stride, rows, r);
        continue;
      }
#endif
      expand_dot::split_pairs(pair_buf.data() + it.pairs, vrows, v_stride, rows, r);
    }
    pair_base = pair_buf.data();  // read by every thread: not the thread_local itself
  }
#endif
  const int64_t n = int64_t(items.size());
  const int64_t phase = amx::phase_for(tile_mode);
  parallel_items(n, [&](int64_t i) {
    {  // one expand column block, all rows of its segment
      const ExpandItem& it = items[i];
      const auto [b, v_off, y_off] = place(it);
      const int r = p.ranks[it.seg * p.num_slices + it.slice];
#if defined(PUNICA_X_AMX)
      if constexpr (std::is_same_v<T, bf16>) {
        if (it.tiles) {
          const int row0 = p.seg[it.seg], rows = p.seg[it.seg + 1] - row0;
          amx::with_tiles(tile_mode, [&](auto tiles) {
            amx::expand<decltype(tiles)>(phase, y + row0 * y_stride + y_off + it.c0, y_stride,
                                         pair_base + it.pairs, rows, r, b, h_out[it.slice], it.cn);
          });
          return;
        }
      }
#endif
      thread_local Lookahead ahead;  // the successor's B block, over this item's rank rows
      PrefetchCursor* pf = nullptr;
      if (i + 1 < n) {
        const ExpandItem& nx = items[i + 1];
        pf = ahead.plan(place(nx).b, p.ranks[nx.seg * p.num_slices + nx.slice],
                        int64_t(h_out[nx.slice]) * sizeof(W), int64_t(nx.cn) * sizeof(W), r);
      }
      const int pf_step = pf ? ahead.step() : 0;
      const int64_t ld = h_out[it.slice];
      const int row0 = p.seg[it.seg], rows = p.seg[it.seg + 1] - row0;
#if defined(__AVX512BF16__)
      if constexpr (kDotExpand<T>) {
        if (it.pairs >= 0) {
          const bf16* vb = pair_base + it.pairs;
          const int stride = expand_dot::pair_stride(r);
          for (int m0 = 0; m0 < rows; m0 += kMB) {
            const int mb = std::min(kMB, rows - m0);
            expand_dot::kernel<kMB>(mb, it.cn)(vb + m0 * stride, stride, expand_dot::half(r), r, b, ld,
                                              y + (row0 + m0) * y_stride + y_off + it.c0, y_stride,
                                              it.cn, pf, pf_step);
          }
          return;
        }
      }
#endif
      const int vec_cols = it.cn / kLanes * kLanes;
      for (int m0 = 0; m0 < rows; m0 += kMB) {
        const int mb = std::min(kMB, rows - m0);
        const float* vrow = v + (row0 + m0) * v_stride + v_off;
        T* yrow = y + (row0 + m0) * y_stride + y_off + it.c0;
        if (vec_cols > 0)
          expand_kernel<T, W>(mb, vec_cols / kLanes)(vrow, v_stride, r, b, ld, yrow, y_stride, pf, pf_step);
        if (vec_cols < it.cn)
          expand_cols_scalar(vrow, v_stride, mb, r, b + vec_cols, ld, it.cn - vec_cols,
                             yrow + vec_cols, y_stride);
      }
    }
  }, [&] { amx::end_phase(tile_mode, phase); });
  (void)pair_base;
}

template void sgmv_shrink_cpu<float, float>(float*, int64_t, const float*, int64_t, int,
                                             const SgmvSegments&);
template void sgmv_shrink_cpu<float, simd::bf16>(float*, int64_t, const float*, int64_t, int,
                                                  const SgmvSegments&);
template void sgmv_shrink_cpu<simd::bf16, simd::bf16>(float*, int64_t, const simd::bf16*, int64_t,
                                                       int, const SgmvSegments&);
template void sgmv_expand_cpu<float, float>(float*, int64_t, const float*, int64_t,
                                             const int32_t*, const SgmvSegments&);
template void sgmv_expand_cpu<float, simd::bf16>(float*, int64_t, const float*, int64_t,
                                                  const int32_t*, const SgmvSegments&);
template void sgmv_expand_cpu<simd::bf16, simd::bf16>(simd::bf16*, int64_t, const float*, int64_t,
                                                       const int32_t*, const SgmvSegments&);

}  // namespace punica_x
