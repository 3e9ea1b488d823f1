// Quantized dense GEMM with integer activations (quant.h, qgemm_xq_cpu). Each 32-value block
// of an x row is rounded to int8 (llama.cpp's way of multiplying ggml blocks) or int16 with its
// own float scale (dx = max|x| / 127 or / 32767), and a block of W meets it in integer dot
// products:
//   Q4_0: sum (q - 8) xq     Q4_1: sum q xq (+ m * dx sum xq, the min's term, in float)
//   Q8_0: sum q xq
// each scaled once per block by dw * dx into float32 accumulators. A block costs a few integer
// instructions (nibbles split, one or two dot products per row of x, one convert, one FMA)
// where the float path (quant_cpu.cpp) widens and converts every weight: the decode step of a
// quantized model is compute-bound there, and nearer the weights' byte stream here.
//
// Dot products: int8: AVX512-VNNI's vpdpbusd (the avx512_bf16 build, whose CPUs all have it;
// 256-bit lanes) or AVX2's vpmaddubsw + vpmaddwd (no saturation: |products| stay below 2^15 in
// pairs, nibbles times int8 or |q| times the sign-moved int8 of Q8_0); int16: vpdpwssd or
// vpmaddwd. Generic builds run the same arithmetic in scalar code.
//
// The cost is x's rounding: y moves by sum (x - dx xq) w, |x - dx xq| <= dx / 2 a value (Q4_1's
// min meets the rounded x too, so the error scales with the centred |w|, not with |d q|). int8
// is what llama.cpp serves with, and a block holding one of a model's outlier activations
// rounds its other values coarsely (SmolLM2-135M: prompt logprobs move by up to ~1 nat); int16
// moves them by float32-summation amounts. qgemm_cpu keeps x exact (the reference).
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

// x rounded per block: q[m * k + i] (int8 or int16); per block b of row m: scale d, the sum
// of its integers and that sum times d (the rounded block's sum: Q4_1's min term).
template <typename Q>
struct XQ {
  std::vector<Q> q;
  std::vector<float> d, sum_x;
  std::vector<int32_t> sum_q;
};

template <typename Q>
constexpr float kQMax = sizeof(Q) == 1 ? 127.f : 32767.f;

template <typename Q, typename T>
void quantize_x(const T* x, int64_t xs, int m, int k, XQ<Q>& out) {
  const int nb = k / kBlock;
  out.q.resize(size_t(m) * k);
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
      const float d = finite ? amax / kQMax<Q> : NAN, id = finite && d > 0.f ? 1.f / d : 0.f;
      Q* q = out.q.data() + int64_t(r) * k + b * kBlock;
      int32_t sq = 0;
      for (int i = 0; i < kBlock; ++i) {
        q[i] = Q(std::nearbyint(v[i] * id));  // |v * id| <= kQMax
        sq += q[i];
      }
      const int64_t at = int64_t(r) * nb + b;
      out.d[at] = d, out.sum_x[at] = d * float(sq), out.sum_q[at] = sq;
    }
}

constexpr int kNR = 4;  // rows of W per tile
// rows of x per tile: accumulators MR x NR ymm + xq MR + unpacked W NR within the registers
// (AVX-512 builds have 32 ymm, AVX2 16)
constexpr int kMR = simd::kVecRegs == 32 ? 4 : 2;
constexpr int kAhead = 512;  // bytes of a W row prefetched ahead

#if defined(__AVX2__)
// acc + the sums of 4 adjacent byte products u * s per int32 lane (u unsigned, s signed).
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// acc + the sums of 2 adjacent int16 products a * b per int32 lane.
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// A block of 32 values (of x or W) in registers: int8 activations: one vector, value i at byte
// i; int16: two, values 0..15 and 16..31.
template <typename Q>
struct Vec {
  static constexpr int n = sizeof(Q);
  __m256i v[n];
};

template <typename Q>
inline Vec<Q> load_x(const Q* p) {
  Vec<Q> x;
  for (int i = 0; i < Vec<Q>::n; ++i) x.v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + i);
  return x;
}

// A W block's 32 weights as dot's W factor. int8 x: the nibbles 0..15 (Q4), or Q8_0's signed
// bytes (made unsigned per row of x in block_dot); int16 x: every weight widened to int16.
template <int F, typename Q>
inline Vec<Q> unpack(const uint8_t* blk) {
  Vec<Q> w;
  if constexpr (F == kQ8_0) {
    if constexpr (sizeof(Q) == 1) {
      w.v[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      w.v[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
      w.v[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
    }
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == kQ4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    if constexpr (sizeof(Q) == 1) {
      w.v[0] = _mm256_set_m128i(hi, lo);
    } else {
      w.v[0] = _mm256_cvtepu8_epi16(lo);
      w.v[1] = _mm256_cvtepu8_epi16(hi);
    }
  }
  return w;
}

// One block's integer dot product of W (unpacked) and x's block, plus `init`.
template <int F, typename Q>
inline __m256i block_dot(const Vec<Q>& w, const Vec<Q>& x, __m256i init) {
  if constexpr (sizeof(Q) == 2) {
    return dot2(dot2(init, w.v[0], x.v[0]), w.v[1], x.v[1]);
  } else if constexpr (F == kQ8_0) {
    return dot4(init, _mm256_sign_epi8(w.v[0], w.v[0]), _mm256_sign_epi8(x.v[0], w.v[0]));
  } else {
    return dot4(init, w.v[0], x.v[0]);
  }
}

// y[0:MR, 0:NR] of one tile: rows of x against rows of W, blocks [0, nb).
template <int F, int MR, int NR, typename Q, typename T>
void tile(const uint8_t* w, int64_t wrb, const XQ<Q>& x, int64_t x_row0, int k, int nb, const T* bias, T* y,
          int64_t ys) {
  constexpr int bb = block_bytes(F);
  __m256 acc[MR][NR];
  float mins[MR][NR] = {};
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    Vec<Q> xq[MR];
    float dx[MR];
    __m256i init[MR];
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (x_row0 + m) * nb + b;
      xq[m] = load_x(x.q.data() + (x_row0 + m) * k + b * kBlock);
      dx[m] = x.d[at];
      // Q4_0's -8 offset: sum (q - 8) xq = sum q xq - 8 sum xq, in one lane (the lanes are
      // summed in the end)
      init[m] = F == kQ4_0 ? _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * x.sum_q[at])) : _mm256_setzero_si256();
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * wrb + b * bb;
      __builtin_prefetch(blk + kAhead);
      const Vec<Q> wv = unpack<F, Q>(blk);
      const float dw = half(blk);
      for (int m = 0; m < MR; ++m) {
        const __m256i dot = block_dot<F>(wv, xq[m], init[m]);
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[m]), acc[m][r]);
      }
      if constexpr (F == kQ4_1) {
        const float mw = half(blk + 2);
        for (int m = 0; m < MR; ++m) mins[m][r] += mw * x.sum_x[(x_row0 + m) * nb + b];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m][r]), _mm256_extractf128_ps(acc[m][r], 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      const float sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2))) + mins[m][r];
      y[m * ys + r] = narrow<T>(sum + (bias ? f32(bias[r]) : 0.f));
    }
}
#else
// Scalar: the same sums in the same integer arithmetic.
template <int F, int MR, int NR, typename Q, typename T>
void tile(const uint8_t* w, int64_t wrb, const XQ<Q>& x, int64_t x_row0, int k, int nb, const T* bias, T* y,
          int64_t ys) {
  constexpr int bb = block_bytes(F);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float sum = 0.f;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = w + r * wrb + b * bb;
        const Q* xq = x.q.data() + (x_row0 + m) * k + b * kBlock;
        const int64_t at = (x_row0 + m) * nb + b;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          int q;
          if constexpr (F == kQ8_0)
            q = int8_t(blk[2 + i]);
          else {
            const uint8_t byte = blk[(F == kQ4_1 ? 4 : 2) + i % 16];
            q = (i < 16 ? byte & 15 : byte >> 4) - (F == kQ4_0 ? 8 : 0);
          }
          dot += q * xq[i];
        }
        sum += float(dot) * half(blk) * x.d[at];
        if constexpr (F == kQ4_1) sum += half(blk + 2) * x.sum_x[at];
      }
      y[m * ys + r] = narrow<T>(sum + (bias ? f32(bias[r]) : 0.f));
    }
}
#endif

template <int F, typename Q, typename T>
void rows_tile(const uint8_t* w, int64_t wrb, const XQ<Q>& x, int m, int k, const T* bias, T* y, int64_t ys, int nr) {
  const int nb = k / kBlock;
  auto run = [&](auto mr_c, int m0) {
    constexpr int MR = decltype(mr_c)::value;
    T* ym = y + m0 * ys;
    switch (nr) {
      case 4: return tile<F, MR, 4>(w, wrb, x, m0, k, nb, bias, ym, ys);
      case 3: return tile<F, MR, 3>(w, wrb, x, m0, k, nb, bias, ym, ys);
      case 2: return tile<F, MR, 2>(w, wrb, x, m0, k, nb, bias, ym, ys);
      default: return tile<F, MR, 1>(w, wrb, x, m0, k, nb, bias, ym, ys);
    }
  };
  static_assert(kNR == 4, "rows_tile dispatches nr 1..4");
  for_row_tiles<kMR>(m, run);
}

template <int F, typename Q, typename T>
void qgemm_xq(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias, int m, int k,
              int n) {
  XQ<Q> xq;
  quantize_x(x, xs, m, k, xq);
  constexpr int rows_per_item = 4 * kNR;
  parallel_items((n + rows_per_item - 1) / rows_per_item, [&](int64_t item) {
    const int lo = int(item) * rows_per_item, hi = std::min(n, lo + rows_per_item);
    for (int r0 = lo; r0 < hi; r0 += kNR)
      rows_tile<F>(w + r0 * wrb, wrb, xq, m, k, bias ? bias + r0 : nullptr, y + r0, ys, std::min(kNR, hi - r0));
  });
}

template <typename Q, typename T>
void by_format(int format, T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int64_t wrb, const T* bias,
               int m, int k, int n) {
  switch (format) {
    case kQ4_0: return qgemm_xq<kQ4_0, Q>(y, ys, x, xs, w, wrb, bias, m, k, n);
    case kQ4_1: return qgemm_xq<kQ4_1, Q>(y, ys, x, xs, w, wrb, bias, m, k, n);
    case kQ8_0: return qgemm_xq<kQ8_0, Q>(y, ys, x, xs, w, wrb, bias, m, k, n);
  }
}

}  // namespace

template <typename T>
void qgemm_xq_cpu(T* y, int64_t ys, const T* x, int64_t xs, const uint8_t* w, int64_t wrb, int format, const T* bias,
                  int m, int k, int n, int x_bits) {
  if (x_bits == 8) return by_format<int8_t>(format, y, ys, x, xs, w, wrb, bias, m, k, n);
  return by_format<int16_t>(format, y, ys, x, xs, w, wrb, bias, m, k, n);
}

template void qgemm_xq_cpu<float>(float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int, const float*,
                                  int, int, int, int);
template void qgemm_xq_cpu<simd::bf16>(simd::bf16*, int64_t, const simd::bf16*, int64_t, const uint8_t*, int64_t, int,
                                       const simd::bf16*, int, int, int, int);

}  // namespace quant
}  // namespace punica_x
