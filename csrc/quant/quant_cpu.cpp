// Quantized dense GEMM on the CPU (quant.h): W stays in its ggml blocks; a block's weights are
// unpacked in registers (bytes widened, nibbles split, times the scale, plus the min) and
// multiplied in float32 with x, accumulated per output in float32.
//
// Decode (M <= kMR rows): one register tile of M x kNR outputs unpacks each block once for all
// M rows, straight from the weight's bytes, so a step reads the file's bytes and nothing else.
// More rows (prefill): each work item unpacks its rows of W once into a per-thread float panel
// (<= kPanelBytes, kept in L2) and every tile of kMR rows reads the panel instead of unpacking
// again.
//
// A block's 32 weights come in pairs of vectors (lanes j*L.. and 16 + j*L.., j < 16 / L): the
// low and high nibbles of one load of L bytes in Q4_0/Q4_1, two loads in Q8_0, so a format is
// one small function and the tiles do not know it.
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/parallel.h"
#include "../common/simd.h"

namespace punica_x {
namespace quant {
namespace {

using namespace simd;

constexpr int kPairs = 16 / kLanes;  // vector pairs per block: 1 (AVX-512), 2 (AVX2), 4 (generic)
// Tile: kMR rows of x by kNR rows of W; accumulators + x pairs + one unpacked pair fit the
// registers (AVX-512: 16 + 8 + 2 of 32; AVX2: 8 + 4 + 2 of 16).
constexpr int kMR = kVecRegs == 32 ? 4 : 2;
constexpr int kNR = 4;
constexpr int64_t kPanelBytes = 256 << 10;
constexpr int kAhead = 512;  // bytes of a W row prefetched ahead of the block being unpacked

// L bytes at p widened to L int32 lanes, zero- or sign-extended (one vpmovzxbd / vpmovsxbd: GCC
// scalarizes a generic uint8 -> float vector conversion into 16 extracts and converts).
template <bool Signed>
inline vi widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi>(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi>(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi v;
  for (int i = 0; i < kLanes; ++i) v[i] = Signed ? int(int8_t(p[i])) : int(p[i]);
  return v;
#endif
}

// A block's scale and offset: w = q * s.first + s.second (Q8_0: offset 0, q signed).
template <int F>
inline void scales(const uint8_t* b, float& s, float& o) {
  s = half(b);
  o = F == kQ4_1 ? half(b + 2) : F == kQ4_0 ? -8.f * s : 0.f;
}

// Pair j of a block: weights j*L .. j*L+L-1 into lo, 16+j*L .. into hi.
template <int F>
inline void pair(const uint8_t* b, int j, vf s, vf o, vf& lo, vf& hi) {
  if constexpr (F == kQ8_0) {
    lo = __builtin_convertvector(widen<true>(b + 2 + j * kLanes), vf) * s;
    hi = __builtin_convertvector(widen<true>(b + 18 + j * kLanes), vf) * s;
  } else {
    const vi q = widen<false>(b + (F == kQ4_1 ? 4 : 2) + j * kLanes);
    lo = __builtin_convertvector(q & 15, vf) * s + o;
    hi = __builtin_convertvector(q >> 4, vf) * s + o;
  }
}

// Unpacks from the blocks themselves (decode).
template <int F>
struct Blocks {
  const uint8_t* w;  // the tile's first row
  int64_t row_bytes;
  static constexpr int bb = block_bytes(F);

  struct Scale {
    float s[kNR], o[kNR];
  };
  Scale block_scales(int b, int nr) const {
    Scale sc;
    for (int r = 0; r < nr; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * bb;
      __builtin_prefetch(blk + kAhead);  // the rows are read once: ask for them early
      scales<F>(blk, sc.s[r], sc.o[r]);
    }
    return sc;
  }
  void get(const Scale& sc, int r, int b, int j, vf& lo, vf& hi) const {
    pair<F>(w + r * row_bytes + b * bb, j, splat(sc.s[r]), splat(sc.o[r]), lo, hi);
  }
};

// Reads an unpacked float panel (prefill): row r's weight k at p[r * k_total + k].
struct Panel {
  const float* p;
  int64_t stride;
  struct Scale {};
  Scale block_scales(int, int) const { return {}; }
  void get(const Scale&, int r, int b, int j, vf& lo, vf& hi) const {
    const float* q = p + r * stride + b * kBlock + j * kLanes;
    lo = load(q);
    hi = load(q + 16);
  }
};

// y[0:MR, 0:NR] of one tile: sum over K of x row times W row; bias added after the sum.
// Few rows keep the low and high halves' sums apart where the registers hold them (two
// dependency chains per output instead of one, or the FMA latency bounds a decode step).
template <int MR, int NR, typename TX, typename T, typename Src>
void tile(const Src& src, const TX* x, int64_t xs, int nblocks, const T* bias, T* y, int64_t ys) {
  constexpr int S = 2 * MR * NR + 2 * MR + 2 <= kVecRegs ? 2 : 1;
  vf acc[S][MR][NR] = {};
  for (int b = 0; b < nblocks; ++b) {
    const auto sc = src.block_scales(b, NR);
#pragma GCC unroll 4
    for (int j = 0; j < kPairs; ++j) {
      vf xl[MR], xh[MR];
      for (int m = 0; m < MR; ++m) {
        xl[m] = load(x + m * xs + b * kBlock + j * kLanes);
        xh[m] = load(x + m * xs + b * kBlock + 16 + j * kLanes);
      }
      for (int r = 0; r < NR; ++r) {
        vf lo, hi;
        src.get(sc, r, b, j, lo, hi);
        for (int m = 0; m < MR; ++m) {
          if constexpr (S == 2) {
            acc[0][m][r] += lo * xl[m];
            acc[1][m][r] += hi * xh[m];
          } else {
            acc[0][m][r] += lo * xl[m] + hi * xh[m];
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const vf a = S == 2 ? acc[0][m][r] + acc[S - 1][m][r] : acc[0][m][r];
      const float sum = hsum(a) + (bias ? f32(bias[r]) : 0.f);
      y[m * ys + r] = narrow<T>(sum);
    }
}

// Rows [0, m) of x against W rows [0, nr) of src (nr <= kNR): tiles of up to kMR rows.
template <typename TX, typename T, typename Src>
void tile_rows(const Src& src, const TX* x, int64_t xs, int nblocks, const T* bias, T* y, int64_t ys, int m, int nr,
               bool fixed) {
  auto run = [&](auto mr_c, int m0) {
    constexpr int MR = decltype(mr_c)::value;
    const TX* xm = x + m0 * xs;
    T* ym = y + m0 * ys;
    switch (nr) {
      case 4: return tile<MR, 4>(src, xm, xs, nblocks, bias, ym, ys);
      case 3: return tile<MR, 3>(src, xm, xs, nblocks, bias, ym, ys);
      case 2: return tile<MR, 2>(src, xm, xs, nblocks, bias, ym, ys);
      default: return tile<MR, 1>(src, xm, xs, nblocks, bias, ym, ys);
    }
  };
  static_assert(kNR == 4, "tile_rows dispatches nr 1..4");
  if (fixed) {  // batch-invariant: one row per tile, so a row's chains do not depend on m
    for (int m0 = 0; m0 < m; ++m0) run(std::integral_constant<int, 1>{}, m0);
    return;
  }
  for_row_tiles<kMR>(m, run);
}

// Unpacks rows [0, nr) of W (blocks) into out (nr x K floats, row stride k).
template <int F, typename PT>
void unpack_rows(const uint8_t* w, int64_t row_bytes, int nr, int k, PT* out) {
  constexpr int bb = block_bytes(F);
  for (int r = 0; r < nr; ++r)
    for (int b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = w + r * row_bytes + b * bb;
      float s, o;
      scales<F>(blk, s, o);
      for (int j = 0; j < kPairs; ++j) {
        vf lo, hi;
        pair<F>(blk, j, splat(s), splat(o), lo, hi);
        store(out + int64_t(r) * k + b * kBlock + j * kLanes, lo);
        store(out + int64_t(r) * k + b * kBlock + 16 + j * kLanes, hi);
      }
    }
}

template <int F, typename TX, typename T>
void panel_gemm(T* y, int64_t ys, const TX* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias, int m, int k,
                int n, bool fixed);

template <int F, typename T>
void decode(T* y, int64_t ys, const float* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias, int m, int k,
            int n, bool fixed) {
  const int nblocks = k / kBlock;
  constexpr int rows_per_item = 4 * kNR;
  parallel_items((n + rows_per_item - 1) / rows_per_item, [&](int64_t item) {
    const int lo = int(item) * rows_per_item, hi = std::min(n, lo + rows_per_item);
    for (int r0 = lo; r0 < hi; r0 += kNR) {
      const Blocks<F> src{w + r0 * wrb, wrb};
      tile_rows(src, x, xs, nblocks, bias ? bias + r0 : nullptr, y + r0, ys, m, std::min(kNR, hi - r0), fixed);
    }
  });
}

template <int F, typename T>
void qgemm(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias, int m, int k,
           int n, bool fixed) {
  // x widened to float32 once (every tile reads all of it); then decode (m <= kMR rows: W
  // unpacked in registers, kNR rows of W per tile, items of 4 tiles) or prefill (items of W
  // rows unpacked once into the thread's panel)
  auto run = [&](const float* xf, int64_t xfs) {
    if (m <= kMR) return decode<F>(y, ys, xf, xfs, w, wrb, bias, m, k, n, fixed);
    return panel_gemm<F>(y, ys, xf, xfs, w, wrb, bias, m, k, n, fixed);
  };
  if constexpr (std::is_same_v<T, float>) {
    return run(x, xs);
  } else {
    std::vector<float> xf(size_t(m) * k);  // a prefill's is large: not kept past the call
    for (int r = 0; r < m; ++r)
      for (int c = 0; c < k; c += kLanes) store(xf.data() + int64_t(r) * k + c, load(x + r * xs + c));
    return run(xf.data(), int64_t(k));
  }
}

template <int F, typename TX, typename T>
void panel_gemm(T* y, int64_t ys, const TX* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias, int m, int k,
                int n, bool fixed) {
  const int nblocks = k / kBlock;
  const int rows = int(std::clamp<int64_t>(kPanelBytes / (int64_t(k) * 4) / kNR * kNR, kNR, 256));
  parallel_items((n + rows - 1) / rows, [&](int64_t item) {
    thread_local std::vector<float> panel;
    const int lo = int(item) * rows, nr = std::min(n - lo, rows);
    panel.resize(size_t(nr) * k);
    unpack_rows<F>(w + lo * wrb, wrb, nr, k, panel.data());
    for (int r0 = 0; r0 < nr; r0 += kNR) {
      const Panel src{panel.data() + int64_t(r0) * k, k};
      tile_rows(src, x, xs, nblocks, bias ? bias + lo + r0 : nullptr, y + lo + r0, ys, m, std::min(kNR, nr - r0),
                fixed);
    }
  });
}

template <int F, typename T>
void dequant_rows(T* out, int64_t os, const uint8_t* w, int64_t wrb, const int64_t* rows, int64_t count, int k) {
  parallel_items(count, [&](int64_t i) {
    unpack_rows<F>(w + rows[i] * wrb, wrb, 1, k, out + i * os);
  });
}

template <int F, typename T>
void dequant_grouped_rows(T* out, int64_t os, const uint8_t* w, const int64_t* rows, int64_t count, int k) {
  const int64_t rb = int64_t(k / kBlock) * block_bytes(F);
  parallel_items(count, [&](int64_t i) {
    thread_local std::vector<uint8_t> row;
    row.resize(size_t(rb));
    ungroup_row(row.data(), w, F, rows[i], k);
    unpack_rows<F>(row.data(), rb, 1, k, out + i * os);
  });
}

}  // namespace

template <typename T>
void qgemm_cpu(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int64_t wrb, int format, const T* bias,
               int m, int k, int n, bool fixed_order) {
  for_format(format, [&](auto f) { qgemm<decltype(f)::value>(y, ys, x, xs, w, wrb, bias, m, k, n, fixed_order); });
}

template <typename T>
void dequant_rows_cpu(T* out, int64_t os, const uint8_t* w, int64_t wrb, int format, const int64_t* rows,
                      int64_t count, int k) {
  for_format(format, [&](auto f) { dequant_rows<decltype(f)::value>(out, os, w, wrb, rows, count, k); });
}

template <typename T>
void dequant_grouped_rows_cpu(T* out, int64_t os, const uint8_t* w, int format, const int64_t* rows, int64_t count,
                              int k) {
  for_format(format, [&](auto f) { dequant_grouped_rows<decltype(f)::value>(out, os, w, rows, count, k); });
}

int64_t first_bad_row(const uint8_t* w, int64_t wrb, int format, int64_t n, int k) {
  const int bb = block_bytes(format);
  const int halves = format == kQ4_1 ? 2 : 1;
  for (int64_t r = 0; r < n; ++r)
    for (int b = 0; b < k / kBlock; ++b)
      for (int h = 0; h < halves; ++h)
        if (!std::isfinite(half(w + r * wrb + b * bb + 2 * h))) return r;
  return -1;
}

template void qgemm_cpu<float>(float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int, const float*,
                               int, int, int, bool);
template void qgemm_cpu<simd::bf16>(simd::bf16*, int64_t, const simd::bf16*, int64_t, const uint8_t*, int64_t, int,
                                    const simd::bf16*, int, int, int, bool);
template void dequant_grouped_rows_cpu<float>(float*, int64_t, const uint8_t*, int, const int64_t*, int64_t, int);
template void dequant_grouped_rows_cpu<simd::bf16>(simd::bf16*, int64_t, const uint8_t*, int, const int64_t*, int64_t,
                                                   int);
template void dequant_rows_cpu<float>(float*, int64_t, const uint8_t*, int64_t, int, const int64_t*, int64_t, int);
template void dequant_rows_cpu<simd::bf16>(simd::bf16*, int64_t, const uint8_t*, int64_t, int, const int64_t*,
                                           int64_t, int);

}  // namespace quant
}  // namespace punica_x
