// Quantized dense GEMM with integer activations over row groups (quant.h: qgemm_grouped_cpu,
// group_rows_cpu). Each 32-value block of an x row is rounded to integers with its own float
// scale dx (int8: |xq| <= 127, llama.cpp's way of multiplying ggml blocks; int16: |xq| <=
// 16256 = 127 * 128, carried as two int8 parts xq = 128 xh + xl, |xh| <= 127, |xl| <= 64) and a
// block of W meets it in integer dot products:
//   Q4_0: sum (q - 8) xq     Q4_1: sum q xq (+ m * dx sum xq, the min's term, in float)
//   Q8_0: sum q xq
// each scaled once per block by dw * dx into float32 accumulators.
//
// W is regrouped once at load (group_rows_cpu): kGroup = 16 rows of W side by side per block,
// their scales (and mins) first, then the quants in 64-byte chunks that give each row one int32
// lane (4 quant bytes of a row per chunk). A chunk meets 4 values of x broadcast to all 16 lanes
// in one dot-product instruction, so the sums land in the row's own lane: no horizontal sums,
// and a block costs one convert and one FMA per row of x for all 16 rows. W is unpacked once per
// block for a tile of rows of x (kMR), and a thread's reads are one sequential stream. At
// decode the kernel streams W at the memory's rate; with 32 rows of x (a batch of 32 decodes) it
// is bound by the dot products themselves, 1.7-2.3x the previous layout's rate (4 rows a block,
// horizontal sums per row and block).
//
// Dot products of unsigned by signed bytes: AVX512-VNNI's vpdpbusd (the avx512_bf16 build,
// whose CPUs all have it) or vpmaddubsw + vpmaddwd (avx512 and AVX2 builds). Q4's nibbles meet x
// as they are; without VNNI a block's 8 vpmaddubsw sums are added in int16 (8 * 2 * 15 * 127 <
// 2^15) and widened once. Q8_0's signed quants meet x as q + 128 with 128 times the block's sum
// of xq subtracted (VNNI), or as |q| against x with q's sign (vpmaddubsw: |q| * |x| <= 128 * 127
// pairs stay below 2^15). Generic builds run the same sums in scalar code.
//
// x is rounded per block in SIMD (the scale from the block's largest |x|; vcvtps2dq rounds to
// nearest even as nearbyint does), rows in parallel for larger batches.
//
// The cost is x's rounding: y moves by sum (x - dx xq) w, |x - dx xq| <= dx / 2 a value (Q4_1's
// min meets the rounded x too, so the error scales with the centred |w|, not with |d q|). int8
// is llama.cpp's arithmetic, and a block holding one of a model's outlier activations rounds
// its other values coarsely (SmolLM2-135M: prompt logprobs move by up to ~1 nat); int16 moves
// them by up to ~0.01 nat in float32, as the same rounding written out in HF moves them
// (tests/punica_x/test_quantized_default_lora.py). qgemm_cpu keeps x exact (the reference).
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

// The integers of one block of 32 values: q0[i] (and q0[plane + i] for P = 2) as XQ stores them;
// their sum.
template <int P>
inline int32_t store_block(int8_t* q0, int64_t plane, const int* xq) {
  int32_t sq = 0;
  for (int i = 0; i < kBlock; ++i) {
    sq += xq[i];
    if constexpr (P == 1) {
      q0[i] = int8_t(xq[i]);
    } else {
      const int hi = (xq[i] + 64) >> 7;  // floor((xq + 64) / 128): |hi| <= 127
      q0[i] = int8_t(hi);
      q0[plane + i] = int8_t(xq[i] - hi * 128);  // -64 .. 63
    }
  }
  return sq;
}

// The scale of a block whose largest |value| is amax: NaN where the block holds a NaN or an
// infinity (every product of the block is then NaN, as in the float path: the integer sums
// could not carry it); its inverse, 0 for a block of zeros or a non-finite one.
template <int P>
inline void block_scale(bool finite, float amax, float& d, float& id) {
  d = finite ? amax / kQMax<P> : NAN;
  id = finite && d > 0.f ? 1.f / d : 0.f;
}

// One block of x (32 values at v) rounded: xq = nearbyint(v / d) (|xq| <= kQMax), stored at q0;
// returns its sum, sets d.
template <int P, typename T>
int32_t quantize_block(const T* v, int8_t* q0, int64_t plane, float& d) {
  alignas(64) int xq[kBlock];
  float id;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static_assert(simd::kLanes == 16, "two vectors a block");
  const __m512 a = reinterpret_cast<__m512>(simd::load(v)), b = reinterpret_cast<__m512>(simd::load(v + 16));
  const __m512 zero = _mm512_setzero_ps();
  // finite: v - v is 0 (NaN for a NaN or an infinity)
  const bool finite = (_mm512_cmp_ps_mask(_mm512_sub_ps(a, a), zero, _CMP_EQ_OQ) &
                       _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_EQ_OQ)) == 0xffff;
  const __m512i no_sign = _mm512_set1_epi32(0x7fffffff);
  const __m512 mag = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), no_sign)),
                                   _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), no_sign)));
  block_scale<P>(finite, finite ? _mm512_reduce_max_ps(mag) : 0.f, d, id);
  // vcvtps2dq rounds to nearest even, as nearbyint does in the default rounding mode
  _mm512_store_si512(xq, finite ? _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id))) : _mm512_setzero_si512());
  _mm512_store_si512(xq + 16, finite ? _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id))) : _mm512_setzero_si512());
#elif defined(__AVX2__)
  static_assert(simd::kLanes == 8, "four vectors a block");
  __m256 x[4];
  __m256 mag = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    x[i] = reinterpret_cast<__m256>(simd::load(v + 8 * i));
    mag = _mm256_max_ps(mag, _mm256_and_ps(x[i], no_sign));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x[i], x[i]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  const bool finite = _mm256_movemask_ps(bad) == 0;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  block_scale<P>(finite, finite ? _mm_cvtss_f32(m4) : 0.f, d, id);
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(xq + 8 * i),
                       finite ? _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(id))) : _mm256_setzero_si256());
#else
  float f[kBlock], amax = 0.f;
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) {
    f[i] = f32(v[i]);
    finite = finite && std::isfinite(f[i]);
    amax = std::max(amax, std::fabs(f[i]));
  }
  block_scale<P>(finite, amax, d, id);
  for (int i = 0; i < kBlock; ++i) xq[i] = finite ? int(std::nearbyint(f[i] * id)) : 0;
#endif
  return store_block<P>(q0, plane, xq);
}

template <int P, typename T>
void quantize_x(const T* x, int64_t xs, int m, int k, XQ& out) {
  const int nb = k / kBlock;
  out.k = k, out.nb = nb, out.plane = int64_t(m) * k;
  out.q.resize(size_t(P) * m * k);
  out.d.resize(size_t(m) * nb);
  out.sum_x.resize(size_t(m) * nb);
  out.sum_q.resize(size_t(m) * nb);
  const auto row = [&](int64_t r) {
    for (int b = 0; b < nb; ++b) {
      const int64_t at = out.idx(int(r), b);
      float d;
      const int32_t sq = quantize_block<P>(x + r * xs + b * kBlock, out.q.data() + r * k + b * kBlock, out.plane, d);
      out.d[at] = d, out.sum_x[at] = d * float(sq), out.sum_q[at] = sq;
    }
  };
  constexpr int64_t kSerial = 8192;  // values below which threads cost more than they save
  if (int64_t(m) * k < kSerial) {
    for (int r = 0; r < m; ++r) row(r);
  } else {
    parallel_items(m, row);
  }
}

// Byte offsets inside a group block of format F (quant.h: kGroup rows): the rows' fp16 scales
// at 0, Q4_1's fp16 mins after them, then the quants in 64-byte chunks: chunk j holds quant
// bytes 4 j .. 4 j + 3 of every row, row r at 4 r (a row's 4 bytes are one int32 lane).
constexpr int qs_at(int f) { return f == kQ4_1 ? 4 * kGroup : 2 * kGroup; }
constexpr int row_qs(int f) { return f == kQ8_0 ? kBlock : kBlock / 2; }
constexpr int chunks(int f) { return row_qs(f) / 4; }
constexpr int quant_at(int f, int r, int i) { return qs_at(f) + (i / 4) * 4 * kGroup + 4 * r + i % 4; }
constexpr int kAhead = 1024;  // bytes of W prefetched ahead of the block being multiplied
// what is subtracted in integers as a multiple of a block's sum xq: Q4_0's offset 8; Q8_0's 128
// where its signed quants meet x as unsigned q + 128 (VNNI builds)
template <int F>
constexpr int offset() {
#if defined(__AVX512VNNI__)
  return F == kQ4_0 ? 8 : F == kQ8_0 ? 128 : 0;
#else
  return F == kQ4_0 ? 8 : 0;
#endif
}

inline int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// y[m, r] for rows r < nr of the group: the lanes of acc (+ bias).
template <typename T>
inline void store_rows(T* y, const float* acc, const T* bias, int nr) {
  for (int r = 0; r < nr; ++r) y[r] = narrow<T>(acc[r] + (bias ? f32(bias[r]) : 0.f));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int P>
constexpr int kMR = 4;  // rows of x per tile

// acc + the sums of 4 adjacent byte products u * s per int32 lane (u unsigned, s signed).
inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// A Q4 block's nibble products: acc + lo * s_lo + hi * s_hi. Without VNNI acc holds int16 pairs
// (a block's 8 vpmaddubsw sums of nibble * int8 pairs stay within 8 * 2 * 15 * 127 < 2^15) and
// nibble_sums() widens them to int32 lanes once a block.
inline __m512i nibble_dot(__m512i acc, __m512i lo, __m512i s_lo, __m512i hi, __m512i s_hi) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, s_lo), hi, s_hi);
#else
  return _mm512_add_epi16(acc, _mm512_add_epi16(_mm512_maddubs_epi16(lo, s_lo), _mm512_maddubs_epi16(hi, s_hi)));
#endif
}

inline __m512i nibble_sums(__m512i acc) {
#if defined(__AVX512VNNI__)
  return acc;
#else
  return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
#endif
}

// One group of 16 rows of W against MR rows of x: int32 lane r is row r, so a chunk of quants
// meets 4 values of x broadcast to every lane, and a block ends in one convert and one FMA
// per row of x for all 16 rows.
template <int F, int MR, int P, typename T>
void group_tile(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  static_assert(kGroup == 16, "one int32 lane a row");
  constexpr int gb = kGroup * block_bytes(F);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead);
    __m512i dot[MR][P];
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < P; ++p) dot[m][p] = _mm512_setzero_si512();
    const auto bcast = [&](int m, int p, int i) { return _mm512_set1_epi32(dword(x.at(p, m0 + m, b) + i)); };
    for (int j = 0; j < chunks(F); ++j) {
      const __m512i v = _mm512_loadu_si512(blk + qs_at(F) + 64 * j);
      if constexpr (F == kQ8_0) {
#if defined(__AVX512VNNI__)
        const __m512i u = _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));  // q + 128
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p) dot[m][p] = dot4(dot[m][p], u, bcast(m, p, 4 * j));
#else
        // |q| against x with q's sign (vpmaddubsw's pairs stay below 2^15)
        const __m512i a = _mm512_abs_epi8(v);
        const __mmask64 neg = _mm512_movepi8_mask(v);
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p) {
            const __m512i s = bcast(m, p, 4 * j);
            dot[m][p] = dot4(dot[m][p], a, _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
          }
#endif
      } else {  // a byte's low nibble is value 4 j + t of the block, its high nibble 16 + 4 j + t
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p) dot[m][p] = nibble_dot(dot[m][p], lo, bcast(m, p, 4 * j), hi, bcast(m, p, 16 + 4 * j));
      }
    }
    const auto halves = [&](int at) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + at))); };
    const __m512 dw = halves(0), mw = F == kQ4_1 ? halves(2 * kGroup) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      __m512i part[P];
      for (int p = 0; p < P; ++p) part[p] = F == kQ8_0 ? dot[m][p] : nibble_sums(dot[m][p]);
      __m512i d = P == 1 ? part[0] : _mm512_add_epi32(_mm512_slli_epi32(part[0], 7), part[P - 1]);
      // the offset times the block's sum of xq
      if constexpr (offset<F>() != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(offset<F>() * x.sum_q[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at])), acc[m]);
      if constexpr (F == kQ4_1) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum_x[at]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float a[16];
    _mm512_store_ps(a, acc[m]);
    store_rows(y + m * ys, a, bias, nr);
  }
}
#elif defined(__AVX2__)
// Rows of x per tile: int16 x (two planes) at MR = 2 (MR = 3 let GCC spill its sums: 2.7
// against 2.2 ms a SmolLM2 layer at 32 rows, one thread), int8 x at MR = 4.
template <int P>
constexpr int kMR = P == 1 ? 4 : 2;

// A Q4 block's nibble products in int16 pairs, widened once a block (as the AVX-512 build
// without VNNI does).
inline __m256i nibble_dot(__m256i acc, __m256i lo, __m256i s_lo, __m256i hi, __m256i s_hi) {
  return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, s_lo), _mm256_maddubs_epi16(hi, s_hi)));
}

// Half h of the group (rows 8 h .. 8 h + 7, eight int32 lanes) against MR rows of x over every
// block, into acc[m] (lane r: row 8 h + r). A tile takes one half at a time so that its sums
// stay in the 16 registers: taking both halves of a 64-byte chunk at once (one x broadcast for
// both) spilled the sums and the broadcasts to the stack on every block, and ran at ~9
// multiply-adds a cycle where this runs ~2x as many (AMD EPYC Zen 4, 32 rows). The second half
// reads the group's blocks from the cache the first half brought them into.
template <int F, int MR, int P>
inline void half_tile(const uint8_t* w, int nb, int h, const XQ& x, int m0, __m256 (&acc)[MR]) {
  constexpr int gb = kGroup * block_bytes(F);
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + int64_t(b) * gb;
    __builtin_prefetch(blk + kAhead + 32 * h);
    __m256i dot[MR][P];
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < P; ++p) dot[m][p] = _mm256_setzero_si256();
    const auto bcast = [&](int m, int p, int i) { return _mm256_set1_epi32(dword(x.at(p, m0 + m, b) + i)); };
#pragma GCC unroll 8
    for (int j = 0; j < chunks(F); ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs_at(F) + 64 * j + 32 * h));
      if constexpr (F == kQ8_0) {
        // |q| against x with q's sign; a pair's sum (<= 2 * 128 * 127) is widened at once
        const __m256i a = _mm256_sign_epi8(v, v);
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p) {
            const __m256i s = _mm256_sign_epi8(bcast(m, p, 4 * j), v);
            dot[m][p] = _mm256_add_epi32(dot[m][p], _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), ones));
          }
      } else {
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p) dot[m][p] = nibble_dot(dot[m][p], lo, bcast(m, p, 4 * j), hi, bcast(m, p, 16 + 4 * j));
      }
    }
    const auto halves = [&](int at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at + 16 * h))); };
    const __m256 dw = halves(0);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = x.idx(m0 + m, b);
      __m256i d;
      if constexpr (F == kQ8_0) {
        d = P == 1 ? dot[m][0] : _mm256_add_epi32(_mm256_slli_epi32(dot[m][0], 7), dot[m][P - 1]);
      } else if constexpr (P == 1) {
        d = _mm256_madd_epi16(dot[m][0], ones);
      } else {  // xq = 128 xh + xl: vpmaddwd widens the xh sums times 128 in one instruction
        d = _mm256_add_epi32(_mm256_madd_epi16(dot[m][0], _mm256_set1_epi16(128)), _mm256_madd_epi16(dot[m][1], ones));
      }
      if constexpr (offset<F>() != 0) d = _mm256_sub_epi32(d, _mm256_set1_epi32(offset<F>() * x.sum_q[at]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at])), acc[m]);
      if constexpr (F == kQ4_1) acc[m] = _mm256_fmadd_ps(halves(2 * kGroup), _mm256_set1_ps(x.sum_x[at]), acc[m]);
    }
  }
}

// AVX2: the group's rows 0-7 and 8-15 as two halves of 8 int32 lanes, one half at a time.
template <int F, int MR, int P, typename T>
void group_tile(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  static_assert(kGroup == 16, "one int32 lane a row");
  for (int h = 0; h < 2 && 8 * h < nr; ++h) {
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    half_tile<F, MR, P>(w, nb, h, x, m0, acc);
    for (int m = 0; m < MR; ++m) {
      alignas(32) float a[8];
      _mm256_store_ps(a, acc[m]);
      store_rows(y + m * ys + 8 * h, a, bias ? bias + 8 * h : nullptr, std::min(8, nr - 8 * h));
    }
  }
}
#else
template <int P>
constexpr int kMR = 1;

// Scalar: the same sums in the same integer arithmetic.
template <int F, int MR, int P, typename T>
void group_tile(const uint8_t* w, int nb, const XQ& x, int m0, const T* bias, T* y, int64_t ys, int nr) {
  constexpr int gb = kGroup * block_bytes(F);
  for (int m = 0; m < MR; ++m) {
    float acc[kGroup] = {};
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = w + int64_t(b) * gb;
      const int64_t at = x.idx(m0 + m, b);
      const int8_t *x0 = x.at(0, m0 + m, b), *x1 = x.at(P - 1, m0 + m, b);
      for (int r = 0; r < nr; ++r) {
        int32_t dot = -offset<F>() * x.sum_q[at];
        for (int i = 0; i < kBlock; ++i) {
          const int q = F == kQ8_0 ? int(int8_t(blk[quant_at(F, r, i)]))
                        : i < 16   ? blk[quant_at(F, r, i)] & 15
                                   : blk[quant_at(F, r, i - 16)] >> 4;
          dot += q * (P == 1 ? x0[i] : 128 * x0[i] + x1[i]);
        }
        acc[r] += float(dot) * (half(blk + 2 * r) * x.d[at]);
        if constexpr (F == kQ4_1) acc[r] += half(blk + 2 * kGroup + 2 * r) * x.sum_x[at];
      }
    }
    store_rows(y + m * ys, acc, bias, nr);
  }
}
#endif

// y[0:m, 0:nr] of one group of W, all rows of x in tiles of kMR.
template <int F, int P, typename T>
void group_rows(const uint8_t* w, int nb, const XQ& x, int m, const T* bias, T* y, int64_t ys, int nr) {
  for_row_tiles<kMR<P>>(m, [&](auto mr_c, int m0) {
    group_tile<F, decltype(mr_c)::value, P>(w, nb, x, m0, bias, y + m0 * ys, ys, nr);
  });
}

template <int F, int P, typename T>
void qgemm_grouped(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, const T* bias, int m, int k, int n) {
  XQ xq;
  quantize_x<P>(x, xs, m, k, xq);
  const int nb = k / kBlock;
  const int64_t group_bytes = int64_t(nb) * kGroup * block_bytes(F);
  parallel_items((n + kGroup - 1) / kGroup, [&](int64_t g) {
    const int r0 = int(g) * kGroup;
    group_rows<F, P>(w + g * group_bytes, nb, xq, m, bias ? bias + r0 : nullptr, y + r0, ys, std::min(kGroup, n - r0));
  });
}

}  // namespace

template <typename T>
void qgemm_grouped_cpu(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int format, const T* bias, int m,
                       int k, int n, int x_bits) {
  for_format(format, [&](auto f) {
    constexpr int F = decltype(f)::value;
    if (x_bits == 8) return qgemm_grouped<F, 1>(y, ys, x, xs, w, bias, m, k, n);
    qgemm_grouped<F, 2>(y, ys, x, xs, w, bias, m, k, n);
  });
}

void group_rows_cpu(uint8_t* out, const uint8_t* w, int64_t wrb, int format, int64_t n, int k) {
  for_format(format, [&](auto f) {
    constexpr int F = decltype(f)::value, bb = block_bytes(F), qs = bb - row_qs(F);
    const int nb = k / kBlock;
    const int64_t groups = (n + kGroup - 1) / kGroup, gb = int64_t(kGroup) * bb;
    parallel_items(groups, [&](int64_t g) {
      uint8_t* dst = out + g * nb * gb;
      std::memset(dst, 0, size_t(nb * gb));  // a last group's missing rows: zero scales and quants
      for (int r = 0; r < kGroup && g * kGroup + r < n; ++r) {
        const uint8_t* row = w + (g * kGroup + r) * wrb;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* src = row + int64_t(b) * bb;
          uint8_t* blk = dst + b * gb;
          std::memcpy(blk + 2 * r, src, 2);                                        // scale
          if (F == kQ4_1) std::memcpy(blk + 2 * kGroup + 2 * r, src + 2, 2);       // min
          for (int i = 0; i < row_qs(F); i += 4) std::memcpy(blk + quant_at(F, r, i), src + qs + i, 4);
        }
      }
    });
  });
}

void ungroup_row(uint8_t* out, const uint8_t* w, int format, int64_t row, int k) {
  for_format(format, [&](auto f) {
    constexpr int F = decltype(f)::value, bb = block_bytes(F), qs = bb - row_qs(F);
    const int nb = k / kBlock, r = int(row % kGroup);
    const uint8_t* group = w + row / kGroup * nb * int64_t(kGroup) * bb;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = group + int64_t(b) * kGroup * bb;
      uint8_t* dst = out + int64_t(b) * bb;
      std::memcpy(dst, blk + 2 * r, 2);
      if (F == kQ4_1) std::memcpy(dst + 2, blk + 2 * kGroup + 2 * r, 2);
      for (int i = 0; i < row_qs(F); i += 4) std::memcpy(dst + qs + i, blk + quant_at(F, r, i), 4);
    }
  });
}

template void qgemm_grouped_cpu<float>(float*, int64_t, const float*, int64_t, const uint8_t*, int, const float*, int,
                                       int, int, int);
template void qgemm_grouped_cpu<simd::bf16>(simd::bf16*, int64_t, const simd::bf16*, int64_t, const uint8_t*, int,
                                            const simd::bf16*, int, int, int, int);

}  // namespace quant
}  // namespace punica_x
