// SGMV expand for bf16 on vdpbf16ps (the avx512_bf16 build), two rank rows per instruction:
//   y[m, c] += sum_i v[m, i] * b[i, c]
// The fp32 tile widens every B vector (two instructions) and spends one FMA per rank row; here
// rows i and i + 1 of B are interleaved into (b[i, c], b[i + 1, c]) pairs with one unpack per
// 16 pairs, and one vdpbf16ps adds both rows' products into 16 columns: about a third of the
// instructions per byte of B.
//
// v is rounded to bf16 first (per row, once per item: ExpandPairs), as HF + PEFT does in bf16
// (its lora_A output is a bf16 tensor); products are exact and sums float32, and y is rounded
// once, after the whole sum, as in the fp32 tile.
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
#include <vector>

#include "../common/prefetch.h"
#include "../common/simd.h"

namespace punica_x {
namespace expand_dot {

using simd::bf16;
using simd::vbh;
using simd::vf;

// v rows [rows, r] float32 rounded to bf16 pairs: rows x even(r), the odd tail padded with 0.
class ExpandPairs {
 public:
  const bf16* convert(const float* v, int64_t vs, int rows, int r) {
    stride_ = (r + 1) & ~1;
    buf_.resize(size_t(rows) * stride_);
    for (int m = 0; m < rows; ++m) {
      bf16* out = buf_.data() + int64_t(m) * stride_;
      for (int k = 0; k < r; k += 16) {
        const __mmask16 mask = __mmask16((1u << std::min(16, r - k)) - 1);
        const __m512 f = _mm512_maskz_loadu_ps(mask, v + m * vs + k);
        _mm256_mask_storeu_epi16(out + k, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
      }
      if (r & 1) out[r] = bf16{0};
    }
    return buf_.data();
  }
  int stride() const { return stride_; }

 private:
  std::vector<bf16> buf_;
  int stride_ = 0;
};

inline __mmask32 unit_mask(int cols, int u) {
  const int n = cols - 32 * u;
  return n >= 32 ? ~__mmask32(0) : __mmask32((uint32_t(1) << n) - 1);
}

// y[m, 0:cols] += vb[m, 0:r] @ b[0:r, 0:cols] for m < MB; cols <= 32 * U (the last unit of 32
// columns may be partial: masked). vb: bf16 pairs (ExpandPairs), row stride vbs.
template <int MB, int U>
void tile(const bf16* vb, int vbs, int r, const bf16* b, int64_t ld, bf16* y, int64_t ys, int cols,
          PrefetchCursor* pf, int pf_step) {
  vf lo[MB][U] = {}, hi[MB][U] = {};
  const __mmask32 tail = unit_mask(cols, U - 1);  // units before the last are full
  auto mask = [tail](int u) { return u + 1 < U ? ~__mmask32(0) : tail; };
  // the loops over m and u are unrolled so the accumulators stay in registers
  for (int i = 0; i < r; i += 2) {
    if (pf) pf->issue(2 * pf_step);
    vbh s[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) s[m] = simd::splat_pair(vb + m * vbs + i);
    const bf16* b0 = b + i * ld;
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const __m512i r0 = _mm512_maskz_loadu_epi16(mask(u), b0 + 32 * u);
      const __m512i r1 =
          i + 1 < r ? _mm512_maskz_loadu_epi16(mask(u), b0 + ld + 32 * u) : _mm512_setzero_si512();
      const vbh pl = (vbh)_mm512_unpacklo_epi16(r0, r1), ph = (vbh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        lo[m][u] = simd::dot_pairs(lo[m][u], pl, s[m]);
        hi[m][u] = simd::dot_pairs(hi[m][u], ph, s[m]);
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

using TileFn = void (*)(const bf16*, int, int, const bf16*, int64_t, bf16*, int64_t, int, PrefetchCursor*, int);

template <int MB, int... U>
constexpr std::array<TileFn, sizeof...(U)> units(std::integer_sequence<int, U...>) {
  return {&tile<MB, U + 1>...};
}

// Widest tiles: one row x kWideUnits (256 columns: B read from memory, 16 accumulators);
// several rows x kNarrowUnits (64 columns: MB x 4 accumulators).
constexpr int kWideUnits = 8, kNarrowUnits = 2;

template <int... M>
constexpr auto narrow_table(std::integer_sequence<int, M...>) {
  return std::array<std::array<TileFn, kNarrowUnits>, sizeof...(M)>{
      units<M + 1>(std::make_integer_sequence<int, kNarrowUnits>{})...};
}

// The tile for mb rows x `cols` columns (cols <= 32 * (mb == 1 ? kWideUnits : kNarrowUnits)).
template <int kMB>
TileFn kernel(int mb, int cols) {
  static const auto wide = units<1>(std::make_integer_sequence<int, kWideUnits>{});
  static const auto narrow = narrow_table(std::make_integer_sequence<int, kMB>{});
  const int u = (cols + 31) / 32;
  return mb == 1 ? wide[u - 1] : narrow[mb - 1][u - 1];
}

}  // namespace expand_dot
}  // namespace punica_x

#endif  // __AVX512BF16__
