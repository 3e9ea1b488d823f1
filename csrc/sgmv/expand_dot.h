// SGMV expand for bf16 on vdpbf16ps (the avx512_bf16 build), two rank rows per instruction:
//   y[m, c] += sum_i v[m, i] * b[i, c]
// The fp32 tile widens every B vector (two instructions) and spends one FMA per rank row; here
// rows i and i + 1 of B are interleaved into (b[i, c], b[i + 1, c]) pairs with one unpack per
// 16 pairs, and two vdpbf16ps (v's hi and lo parts) add both rows' products into 16 columns:
// about half the instructions per byte of B.
//
// v is split into two bf16 parts first (split_pairs, once a launch per segment and slice), so
// the products keep float32 v's precision; products are exact and sums float32, and y is
// rounded once, after the whole sum, as in the fp32 tile.
//
// Column order: unpacklo/hi work within 128-bit lanes, so accumulator `lo` holds columns
// 8L + j and `hi` columns 8L + 4 + j in its lane 4L + j (L < 4, j < 4); the store permutes
// them back (two permutes per 32 columns, once per tile).
#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "../common/prefetch.h"
#include "../common/simd.h"

namespace punica_x {
namespace expand_dot {

using simd::bf16;
using simd::vbh;
using simd::vf;

// v rows [rows, r] float32 as two bf16 parts, hi = bf16(v) and lo = bf16(v - hi), each even(r)
// long with the odd tail padded with 0; hi + lo carries 16 of v's 24 significant bits (a
// relative error of at most 2^-17, far below the output's bf16 rounding), so the expand adds
// two vdpbf16ps per pair of rank rows and keeps float32 v's precision. (Rounding v to bf16
// alone, as HF + PEFT's bf16 lora_A output does, doubled the error against HF float32 of a
// tiny Qwen2 with random rank-8 adapters, past bf16's own: tests/punica_x/models.)
// Row m of a block: hi at m * pair_stride(r), lo at m * pair_stride(r) + half(r).
inline int half(int r) { return (r + 1) & ~1; }
inline int pair_stride(int r) { return 2 * half(r); }

// hi[0:n] = bf16(v[0:n]) and lo[0:n] = bf16(v - hi) for n <= 16; with `full`, 16 of each
// (zeros past n). Also amx.h's split of v.
inline void split16(bf16* hi, bf16* lo, const float* v, int n, bool full) {
  const __mmask16 mask = __mmask16((1u << n) - 1);
  const __m512 f = _mm512_maskz_loadu_ps(mask, v);
  const __m256i h16 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16));
  const __mmask16 out = full ? __mmask16(0xFFFF) : mask;
  _mm256_mask_storeu_epi16(hi, out, h16);
  _mm256_mask_storeu_epi16(lo, out, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(f, back))));
}

// dst[rows x pair_stride(r)] = v[rows, 0:r] (row stride vs) split into hi and lo parts.
inline void split_pairs(bf16* dst, const float* v, int64_t vs, int rows, int r) {
  const int h = half(r);
  for (int m = 0; m < rows; ++m) {
    bf16* hi = dst + int64_t(m) * 2 * h;
    bf16* lo = hi + h;
    if (r < h) hi[r] = lo[r] = bf16{0};  // the pad pairs with B's zero row; garbage could be NaN
    for (int k = 0; k < r; k += 16) split16(hi + k, lo + k, v + m * vs + k, std::min(16, r - k), false);
  }
}

inline __mmask32 unit_mask(int cols, int u) {
  const int n = cols - 32 * u;
  return n >= 32 ? ~__mmask32(0) : __mmask32((uint32_t(1) << n) - 1);
}

// y[m, 0:cols] += v[m, 0:r] @ b[0:r, 0:cols] for m < MB; cols <= 32 * U (the last unit of 32
// columns may be partial: masked). vb: v's hi and lo bf16 parts (split_pairs), row stride vbs,
// lo at vb + lo_off.
template <int MB, int U>
void tile(const bf16* vb, int vbs, int lo_off, int r, const bf16* b, int64_t ld, bf16* y, int64_t ys,
          int cols, PrefetchCursor* pf, int pf_step) {
  vf lo[MB][U] = {}, hi[MB][U] = {};
  const __mmask32 tail = unit_mask(cols, U - 1);  // units before the last are full
  auto mask = [tail](int u) { return u + 1 < U ? ~__mmask32(0) : tail; };
  // the loops over m and u are unrolled so the accumulators stay in registers
  for (int i = 0; i < r; i += 2) {
    if (pf) pf->issue(2 * pf_step);
    vbh s[MB], t[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      s[m] = simd::splat_pair(vb + m * vbs + i);
      t[m] = simd::splat_pair(vb + m * vbs + lo_off + i);
    }
    const bf16* b0 = b + i * ld;
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const __m512i r0 = _mm512_maskz_loadu_epi16(mask(u), b0 + 32 * u);
      const __m512i r1 =
          i + 1 < r ? _mm512_maskz_loadu_epi16(mask(u), b0 + ld + 32 * u) : _mm512_setzero_si512();
      const vbh pl = (vbh)_mm512_unpacklo_epi16(r0, r1), ph = (vbh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        lo[m][u] = simd::dot_pairs(simd::dot_pairs(lo[m][u], pl, s[m]), pl, t[m]);
        hi[m][u] = simd::dot_pairs(simd::dot_pairs(hi[m][u], ph, s[m]), ph, t[m]);
      }
    }
  }
  // output column c of a 16-column half h: lane L = c / 8 + 2h, j = c % 8
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // an empty mask (past `cols`) loads and stores nothing
        const __mmask16 k = __mmask16(mask(u) >> (16 * h));
        const __m512 sum = _mm512_permutex2var_ps(reinterpret_cast<__m512>(lo[m][u]), h ? second : first,
                                                  reinterpret_cast<__m512>(hi[m][u]));
        bf16* out = y + m * ys + 32 * u + 16 * h;
        const __m512i old = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, out)), 16);
        const __m512 total = _mm512_add_ps(_mm512_castsi512_ps(old), sum);
        _mm256_mask_storeu_epi16(out, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(total)));
      }
}

using TileFn = void (*)(const bf16*, int, int, int, const bf16*, int64_t, bf16*, int64_t, int, PrefetchCursor*,
                        int);

template <int MB, int... U>
constexpr std::array<TileFn, sizeof...(U)> units(std::integer_sequence<int, U...>) {
  return {&tile<MB, U + 1>...};
}

// Tiles of several rows x kNarrowUnits (64 columns: MB x 4 accumulators), the items of
// segments of several rows outside fixed order (sgmv_cpu.cpp; a one-row segment, and every
// segment in fixed order, keeps the widening tiles); the last row block of such a segment may
// have one row.
constexpr int kNarrowUnits = 2;

template <int... M>
constexpr auto narrow_table(std::integer_sequence<int, M...>) {
  return std::array<std::array<TileFn, kNarrowUnits>, sizeof...(M)>{
      units<M + 1>(std::make_integer_sequence<int, kNarrowUnits>{})...};
}

// The tile for mb rows x `cols` columns (cols <= 32 * kNarrowUnits).
template <int kMB>
TileFn kernel(int mb, int cols) {
  static const auto narrow = narrow_table(std::make_integer_sequence<int, kMB>{});
  return narrow[mb - 1][(cols + 31) / 32 - 1];
}

}  // namespace expand_dot
}  // namespace punica_x

#endif  // __AVX512BF16__
