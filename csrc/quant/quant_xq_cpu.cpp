// Quantized dense GEMM with integer activations over row groups (quant.h: qgemm_grouped_cpu,
// group_rows_cpu). Each 32-value block of an x row is rounded to integers with its own float
// scale dx (int8: |xq| <= 127, llama.cpp's way of multiplying ggml blocks; int16: |xq| <=
// 16256 = 127 * 128, carried as two int8 parts xq = 128 xh + xl, |xh| <= 127, |xl| <= 64) and a
// block of W meets it in integer dot products:
//   Q4_0: sum (q - 8) xq     Q4_1: sum q xq (+ m * dx sum xq, the min's term, in float)
//   Q8_0: sum q xq
// each scaled once per block by dw * dx into float32 accumulators.
//
// W is regrouped once at load (group_rows_cpu): kGroup = 4 rows of W side by side per block,
// their scales (and mins) first, then each row's quants, so that one 512-bit load holds the
// same block of 4 rows (Q4) and a thread's reads are one sequential stream. A group block
// costs a handful of instructions (nibbles split, one dot product per nibble half and int8
// part of x, one convert, one FMA over 16 lanes) where the block-per-row layout cost that per
// row: at decode the kernel now streams W near the memory's rate instead of being bound by the
// instructions per block, and short rows (K = 576) no longer break the stream into pieces the
// prefetchers restart on.
//
// Dot products of unsigned by signed bytes: AVX512-VNNI's vpdpbusd (the avx512_bf16 build,
// whose CPUs all have it) or vpmaddubsw + vpmaddwd (avx512 and AVX2 builds; no saturation:
// nibble * 127 pairs, and Q8_0's |q| * |x| <= 128 * 127 pairs, stay below 2^15). Q8_0's signed
// quants meet x through |q| and x with q's sign. Generic builds run the same sums in scalar code.
//
// The cost is x's rounding: y moves by sum (x - dx xq) w, |x - dx xq| <= dx / 2 a value (Q4_1's
// min meets the rounded x too, so the error scales with the centred |w|, not with |d q|). int8
// is llama.cpp's arithmetic, and a block holding one of a model's outlier activations rounds
// its other values coarsely (SmolLM2-135M: prompt logprobs move by up to ~1 nat); int16 moves
// them by float32-summation amounts. qgemm_cpu keeps x exact (the reference).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/parallel.h"
#include "../common/simd.h"
#include "quant.h"

namespace punica_x {
namespace quant {
namespace {

using simd::f32;
using simd::narrow;

// x rounded per block: P int8 planes (P = 1: xq; P = 2: xh, xl with xq = 128 xh + xl), plane p
// at q[p * m * k]; per block b of row r (at r * nb + b): scale d, the sum of its integers xq
// and that sum times d (the rounded block's sum: Q4_1's min term).
struct XQ {
  std::vector<int8_t> q;
  std::vector<float> d, sum_x;
  std::vector<int32_t> sum_q;
  int64_t plane = 0;  // m * k
  int k = 0, nb = 0;

  const int8_t* at(int p, int r, int b) const { return q.data() + p * plane + int64_t(r) * k + b * kBlock; }
  int64_t idx(int r, int b) const { return int64_t(r) * nb + b; }
};

template <int P>
constexpr float kQMax = P == 1 ? 127.f : 16256.f;

template <int P, typename T>
void quantize_x(const T* x, int64_t xs, int m, int k, XQ& out) {
  const int nb = k / kBlock;
  out.k = k, out.nb = nb, out.plane = int64_t(m) * k;
  out.q.resize(size_t(P) * m * k);
  out.d.resize(size_t(m) * nb);
  out.sum_x.resize(size_t(m) * nb);
  out.sum_q.resize(size_t(m) * nb);
  for (int r = 0; r < m; ++r)
    for (int b = 0; b < nb; ++b) {
      float v[kBlock], amax = 0.f, sx = 0.f;
      for (int i = 0; i < kBlock; ++i) {
        v[i] = f32(x[r * xs + b * kBlock + i]);
        amax = std::max(amax, std::fabs(v[i]));
        sx += v[i];
      }
      // a NaN or infinity anywhere in the block: every product of the block is NaN, as in
      // the float path (the integer sums could not carry it)
      const bool finite = std::isfinite(sx) && std::isfinite(amax);
      const float d = finite ? amax / kQMax<P> : NAN, id = finite && d > 0.f ? 1.f / d : 0.f;
      int8_t* q0 = out.q.data() + int64_t(r) * k + b * kBlock;
      int32_t sq = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int xq = int(std::nearbyint(v[i] * id));  // |v * id| <= kQMax
        sq += xq;
        if constexpr (P == 1) {
          q0[i] = int8_t(xq);
        } else {
          const int hi = (xq + 64) >> 7;  // floor((xq + 64) / 128): |hi| <= 127
          q0[i] = int8_t(hi);
          q0[out.plane + i] = int8_t(xq - hi * 128);  // -64 .. 63
        }
      }
      const int64_t at = out.idx(r, b);
      out.d[at] = d, out.sum_x[at] = d * float(sq), out.sum_q[at] = sq;
    }
}

// Byte offsets inside a group block of format F: kGroup fp16 scales at 0, Q4_1's kGroup fp16
// mins after them, then each row's quants (16 bytes for Q4, 32 for Q8_0).
constexpr int qs_at(int f) { return f == kQ4_1 ? 4 * kGroup : 2 * kGroup; }
constexpr int row_qs(int f) { return f == kQ8_0 ? kBlock : kBlock / 2; }
constexpr int kAhead = 1024;  // bytes of W prefetched ahead of the block being multiplied
// the Q4_0 offset and Q8_0 (no offset) as multiples of sum xq, subtracted in integers
constexpr int offset(int f) { return f == kQ4_0 ? 8 : 0; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kMR = 4;  // rows of x per tile

// acc + the sums of 4 adjacent byte products u * s per int32 lane (u unsigned, s signed).
inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline float sum4(const float* a) { return (a[0] + a[1]) + (a[2] + a[3]); }

// One group of 4 rows of W in Q4_0 / Q4_1 against MR rows of x. A group block's 64 quant bytes
// are one zmm (row g at bytes 16 g .. 16 g + 15: lane group g of 4 int32 lanes), x's 16 low
// and 16 high values broadcast to the 4 row lanes; y[m, g] = the sum of lanes 4 g .. 4 g + 3.
template <int F, int MR, int P, typename T>
void group_q4(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(F);
  const __m512i nibble = _mm512_set1_epi8(0x0f), per_row = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[MR];
  __m128 mins[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps(), mins[m] = _mm_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead);
    const __m512i v = _mm512_loadu_si512(blk + qs_at(F));
    const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      // Q4_0's -8 offset: sum (q - 8) xq = sum q xq - 8 sum xq, in the first lane of each row
      const __m512i init = offset(F) ? _mm512_maskz_set1_epi32(0x1111, -offset(F) * x.sum_q[at]) : _mm512_setzero_si512();
      const int8_t* xp = x.at(0, m0 + m, b);
      const auto bcast = [](const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
      __m512i dot;
      if constexpr (P == 1) {
        dot = dot4(dot4(init, lo, bcast(xp)), hi, bcast(xp + 16));
      } else {
        const int8_t* xl = x.at(1, m0 + m, b);
        const __m512i h = dot4(dot4(_mm512_setzero_si512(), lo, bcast(xp)), hi, bcast(xp + 16));
        dot = _mm512_add_epi32(_mm512_slli_epi32(h, 7), dot4(dot4(init, lo, bcast(xl)), hi, bcast(xl + 16)));
      }
      const __m512 s = _mm512_permutexvar_ps(per_row, _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_set1_ps(x.d[at]))));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
      if constexpr (F == kQ4_1) {
        const __m128 mw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 * kGroup)));
        mins[m] = _mm_fmadd_ps(mw, _mm_set1_ps(x.sum_x[at]), mins[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float a[16], mn[4];
    _mm512_store_ps(a, acc[m]);
    _mm_store_ps(mn, mins[m]);
    for (int g = 0; g < nr; ++g) y[m * ys + g] = narrow<T>(sum4(a + 4 * g) + mn[g] + (bias ? f32(bias[g]) : 0.f));
  }
}

// One group of 4 rows of W in Q8_0 against MR rows of x: rows 0, 1 of the group block in one zmm
// and rows 2, 3 in another (256 bits a row: 8 int32 lanes), x's block broadcast to both halves
// with each weight's sign moved onto it (vpdpbusd multiplies unsigned by signed).
template <int MR, int P, typename T>
void group_q8(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(kQ8_0);
  const __m512i lo_rows = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi_rows = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead);
    __builtin_prefetch(blk + kAhead + 64);
    __m512i aw[2];
    __mmask64 neg[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(blk + qs_at(kQ8_0) + 64 * h);
      aw[h] = _mm512_abs_epi8(v);
      neg[h] = _mm512_movepi8_mask(v);
    }
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      const __m128 s4 = _mm_mul_ps(dw, _mm_set1_ps(x.d[at]));
      __m512i xv[P];
      for (int p = 0; p < P; ++p)
        xv[p] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.at(p, m0 + m, b))));
      for (int h = 0; h < 2; ++h) {
        __m512i dot = dot4(_mm512_setzero_si512(), aw[h], _mm512_mask_sub_epi8(xv[0], neg[h], _mm512_setzero_si512(), xv[0]));
        if constexpr (P == 2)
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 7),
                                 dot4(_mm512_setzero_si512(), aw[h], _mm512_mask_sub_epi8(xv[1], neg[h], _mm512_setzero_si512(), xv[1])));
        const __m512 s = _mm512_permutexvar_ps(h ? hi_rows : lo_rows, _mm512_castps128_ps512(s4));
        acc[m][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float a[32];
    _mm512_store_ps(a, acc[m][0]);
    _mm512_store_ps(a + 16, acc[m][1]);
    for (int g = 0; g < nr; ++g) y[m * ys + g] = narrow<T>(sum4(a + 8 * g) + sum4(a + 8 * g + 4) + (bias ? f32(bias[g]) : 0.f));
  }
}
#elif defined(__AVX2__)
constexpr int kMR = 2;

inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

inline float sum4(const float* a) { return (a[0] + a[1]) + (a[2] + a[3]); }

// AVX2: the group block's quants in two ymm (rows 0, 1 and rows 2, 3), otherwise as above.
template <int F, int MR, int P, typename T>
void group_q4(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(F);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i rows[2] = {_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2)};
  __m256 acc[MR][2];
  __m128 mins[MR];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps(), mins[m] = _mm_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead);
    __m256i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs_at(F) + 32 * h));
      lo[h] = _mm256_and_si256(v, nibble), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      const __m256i init = offset(F) ? _mm256_setr_epi32(-offset(F) * x.sum_q[at], 0, 0, 0, -offset(F) * x.sum_q[at], 0, 0, 0)
                                     : _mm256_setzero_si256();
      const auto bcast = [](const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
      const __m256i xl0 = bcast(x.at(0, m0 + m, b)), xh0 = bcast(x.at(0, m0 + m, b) + 16);
      const __m256 s4 = _mm256_castps128_ps256(_mm_mul_ps(dw, _mm_set1_ps(x.d[at])));
      for (int h = 0; h < 2; ++h) {
        __m256i dot;
        if constexpr (P == 1) {
          dot = dot4(dot4(init, lo[h], xl0), hi[h], xh0);
        } else {
          const __m256i xl1 = bcast(x.at(1, m0 + m, b)), xh1 = bcast(x.at(1, m0 + m, b) + 16);
          const __m256i top = dot4(dot4(_mm256_setzero_si256(), lo[h], xl0), hi[h], xh0);
          dot = _mm256_add_epi32(_mm256_slli_epi32(top, 7), dot4(dot4(init, lo[h], xl1), hi[h], xh1));
        }
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(s4, rows[h]), acc[m][h]);
      }
      if constexpr (F == kQ4_1) {
        const __m128 mw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 * kGroup)));
        mins[m] = _mm_fmadd_ps(mw, _mm_set1_ps(x.sum_x[at]), mins[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float a[16], mn[4];
    _mm256_store_ps(a, acc[m][0]);
    _mm256_store_ps(a + 8, acc[m][1]);
    _mm_store_ps(mn, mins[m]);
    for (int g = 0; g < nr; ++g) y[m * ys + g] = narrow<T>(sum4(a + 4 * g) + mn[g] + (bias ? f32(bias[g]) : 0.f));
  }
}

// AVX2 Q8_0: one ymm a row of the group (32 quants), its sign moved onto x.
template <int MR, int P, typename T>
void group_q8(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(kQ8_0);
  __m256 acc[MR][kGroup];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < kGroup; ++g) acc[m][g] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead);
    __builtin_prefetch(blk + kAhead + 64);
    float dw[kGroup];
    for (int g = 0; g < kGroup; ++g) dw[g] = half(blk + 2 * g);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      __m256i xv[P];
      for (int p = 0; p < P; ++p) xv[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.at(p, m0 + m, b)));
      for (int g = 0; g < kGroup; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs_at(kQ8_0) + 32 * g));
        const __m256i aw = _mm256_sign_epi8(v, v);
        __m256i dot = dot4(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xv[0], v));
        if constexpr (P == 2)
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), dot4(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xv[1], v)));
        acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[g] * x.d[at]), acc[m][g]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < nr; ++g) {
      alignas(32) float a[8];
      _mm256_store_ps(a, acc[m][g]);
      y[m * ys + g] = narrow<T>(sum4(a) + sum4(a + 4) + (bias ? f32(bias[g]) : 0.f));
    }
}
#else
constexpr int kMR = 1;

// Scalar: the same sums in the same integer arithmetic.
template <int F, int MR, int P, typename T>
void group_any(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(F);
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < nr; ++g) {
      float sum = 0.f;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = w + int64_t(b) * gb;
        const uint8_t* qs = blk + qs_at(F) + row_qs(F) * g;
        const int64_t at = x.idx(m0 + m, b);
        int32_t dot = -offset(F) * x.sum_q[at];
        for (int i = 0; i < kBlock; ++i) {
          const int q = F == kQ8_0 ? int(int8_t(qs[i])) : i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
          const int xq = P == 1 ? x.at(0, m0 + m, b)[i] : 128 * x.at(0, m0 + m, b)[i] + x.at(1, m0 + m, b)[i];
          dot += q * xq;
        }
        sum += float(dot) * (half(blk + 2 * g) * x.d[at]);
        if constexpr (F == kQ4_1) sum += half(blk + 2 * kGroup + 2 * g) * x.sum_x[at];
      }
      y[m * ys + g] = narrow<T>(sum + (bias ? f32(bias[g]) : 0.f));
    }
}
#endif

// y[0:m, 0:nr] of one group of W, all rows of x in tiles of kMR.
template <int F, int P, typename T>
void group_rows(const uint8_t* w, int nb, const XQ& x, int m, const T* bias, T* y, int64_t ys, int nr) {
  auto run = [&](auto mr_c, int m0) {
    constexpr int MR = decltype(mr_c)::value;
#if defined(__AVX2__)
    if constexpr (F == kQ8_0)
      group_q8<MR, P>(w, nb, x, m0, bias, y + m0 * ys, ys, nr);
    else
      group_q4<F, MR, P>(w, nb, x, m0, bias, y + m0 * ys, ys, nr);
#else
    group_any<F, MR, P>(w, nb, x, m0, bias, y + m0 * ys, ys, nr);
#endif
  };
  for_row_tiles<kMR>(m, run);
}

template <int F, int P, typename T>
void qgemm_grouped(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, const T* bias, int m, int k, int n) {
  XQ xq;
  quantize_x<P>(x, xs, m, k, xq);
  const int nb = k / kBlock;
  const int64_t group_bytes = int64_t(nb) * kGroup * block_bytes(F);
  constexpr int groups_per_item = 4;
  const int groups = (n + kGroup - 1) / kGroup;
  parallel_items((groups + groups_per_item - 1) / groups_per_item, [&](int64_t item) {
    const int lo = int(item) * groups_per_item, hi = std::min(groups, lo + groups_per_item);
    for (int g = lo; g < hi; ++g) {
      const int r0 = g * kGroup;
      group_rows<F, P>(w + g * group_bytes, nb, xq, m, bias ? bias + r0 : nullptr, y + r0, ys, std::min(kGroup, n - r0));
    }
  });
}

template <int P, typename T>
void by_format(int format, T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, const T* bias, int m, int k,
               int n) {
  switch (format) {
    case kQ4_0: return qgemm_grouped<kQ4_0, P>(y, ys, x, xs, w, bias, m, k, n);
    case kQ4_1: return qgemm_grouped<kQ4_1, P>(y, ys, x, xs, w, bias, m, k, n);
    case kQ8_0: return qgemm_grouped<kQ8_0, P>(y, ys, x, xs, w, bias, m, k, n);
  }
}

}  // namespace

template <typename T>
void qgemm_grouped_cpu(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int format, const T* bias, int m,
                       int k, int n, int x_bits) {
  if (x_bits == 8) return by_format<1>(format, y, ys, x, xs, w, bias, m, k, n);
  return by_format<2>(format, y, ys, x, xs, w, bias, m, k, n);
}

void group_rows_cpu(uint8_t* out, const uint8_t* w, int64_t wrb, int format, int64_t n, int k) {
  const int bb = block_bytes(format), nb = k / kBlock, qs = format == kQ4_1 ? 4 : 2, q_bytes = bb - qs;
  const int64_t groups = (n + kGroup - 1) / kGroup, gb = int64_t(kGroup) * bb;
  parallel_items(groups, [&](int64_t g) {
    uint8_t* dst = out + g * nb * gb;
    std::memset(dst, 0, size_t(nb * gb));  // a last group's missing rows: zero scales and quants
    for (int r = 0; r < kGroup && g * kGroup + r < n; ++r) {
      const uint8_t* row = w + (g * kGroup + r) * wrb;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* src = row + int64_t(b) * bb;
        uint8_t* blk = dst + b * gb;
        std::memcpy(blk + 2 * r, src, 2);                                              // scale
        if (format == kQ4_1) std::memcpy(blk + 2 * kGroup + 2 * r, src + 2, 2);        // min
        std::memcpy(blk + (qs == 4 ? 4 : 2) * kGroup + q_bytes * r, src + qs, q_bytes);  // quants
      }
    }
  });
}

void ungroup_row(uint8_t* out, const uint8_t* w, int format, int64_t row, int k) {
  const int bb = block_bytes(format), nb = k / kBlock, qs = format == kQ4_1 ? 4 : 2, q_bytes = bb - qs;
  const int64_t gb = int64_t(kGroup) * bb;
  const uint8_t* group = w + row / kGroup * nb * gb;
  const int r = int(row % kGroup);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * gb;
    uint8_t* dst = out + int64_t(b) * bb;
    std::memcpy(dst, blk + 2 * r, 2);
    if (format == kQ4_1) std::memcpy(dst + 2, blk + 2 * kGroup + 2 * r, 2);
    std::memcpy(dst + qs, blk + qs * kGroup + q_bytes * r, q_bytes);
  }
}

template void qgemm_grouped_cpu<float>(float*, int64_t, const float*, int64_t, const uint8_t*, int, const float*, int,
                                       int, int, int);
template void qgemm_grouped_cpu<simd::bf16>(simd::bf16*, int64_t, const simd::bf16*, int64_t, const uint8_t*, int,
                                            const simd::bf16*, int, int, int, int);

}  // namespace quant
}  // namespace punica_x
