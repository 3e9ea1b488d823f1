// Quantized dense projections on the CPU: y[M, N] = x[M, K] @ W^T with W kept in the file's
// own block layout (GGUF / ggml): each row of W is K / 32 blocks, each block 32 weights along K
// with its scale (and min) as stored. Nothing is expanded to a float copy at load; a call
// unpacks blocks in registers (few rows: decode) or into a small per-thread panel it reuses for
// every row block (many rows: prefill).
//
// Formats (ggml's type ids and layouts, ggml-common.h), fp16 scales:
//   Q4_0 (2): { d; qs[16] }       w[j] = d * (q[j] - 8), q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4
//   Q4_1 (3): { d; m; qs[16] }    w[j] = d * q[j] + m, nibbles as Q4_0
//   Q8_0 (8): { d; int8 qs[32] }  w[j] = d * qs[j]
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace punica_x {
namespace quant {

constexpr int kBlock = 32;  // weights per block, every format here
enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// The fp16 at p (a block's scale or min), as float.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(float(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// run(std::integral_constant<int, MR>, m0) over rows [0, m) of x: tiles of MaxMR rows, then
// one tile of the 1..3 rows left (MaxMR <= 4).
template <int MaxMR, typename Run>
inline void for_row_tiles(int m, const Run& run) {
  static_assert(MaxMR <= 4, "tail rows dispatch 1..3");
  int m0 = 0;
  for (; m0 + MaxMR <= m; m0 += MaxMR) run(std::integral_constant<int, MaxMR>{}, m0);
  switch (m - m0) {
    case 1: return run(std::integral_constant<int, 1>{}, m0);
    case 2: return run(std::integral_constant<int, std::min(2, MaxMR)>{}, m0);
    case 3: return run(std::integral_constant<int, std::min(3, MaxMR)>{}, m0);
  }
}

// Bytes of one block of `format`, 0 for a format this file does not serve.
constexpr int block_bytes(int format) {
  return format == kQ4_0 ? 18 : format == kQ4_1 ? 20 : format == kQ8_0 ? 34 : 0;
}

// fn(std::integral_constant<int, F>) for the format id F; nothing for an unknown one (the
// bindings check formats first).
template <typename Fn>
inline void for_format(int format, const Fn& fn) {
  switch (format) {
    case kQ4_0: return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ8_0: return fn(std::integral_constant<int, kQ8_0>{});
  }
}

// T: float or simd::bf16 for x, y and bias (float32 accumulation). w: N rows of K / 32 blocks,
// row-major, rows `w_row_bytes` apart. bias: null or [N]. fixed_order: every row through the
// one-row tile (batch-invariant: its sums then do not depend on how many rows share the call;
// the few-row tiles split them into other dependency chains).
template <typename T>
void qgemm_cpu(T* y, int64_t y_stride, const T* x, int64_t x_stride, const uint8_t* w, int64_t w_row_bytes,
               int format, const T* bias, int m, int k, int n, bool fixed_order = false);

// Row groups for the integer-activation kernel: kGroup rows of W side by side per block. A
// grouped W is ceil(N / kGroup) groups of K / 32 group blocks, kGroup * block_bytes(format)
// bytes each: the rows' fp16 scales, Q4_1's fp16 mins, then the quants in 64-byte chunks, chunk j
// holding quant bytes 4 j .. 4 j + 3 of every row (row r at 4 r: one int32 lane a row); a last
// group's missing rows are zeros.
constexpr int kGroup = 16;

// out (ceil(n / kGroup) * K / 32 * kGroup * block_bytes(format) bytes) = w (n rows, row_bytes
// apart) regrouped.
void group_rows_cpu(uint8_t* out, const uint8_t* w, int64_t w_row_bytes, int format, int64_t n, int k);

// Row `row` of a grouped W back in the file's layout (K / 32 * block_bytes(format) bytes).
void ungroup_row(uint8_t* out, const uint8_t* w, int format, int64_t row, int k);

// y = x @ W^T (+ bias) for a grouped W of n rows, x rounded per block of 32 to integers of
// x_bits (8: |xq| <= 127, llama.cpp's arithmetic; 16: |xq| <= 16256) with a float scale each, and
// integer dot products (quant_xq_cpu.cpp). |error| per value <= half x's step (1/254 or 1/32512
// of the block's largest |x|).
template <typename T>
void qgemm_grouped_cpu(T* y, int64_t y_stride, const T* x, int64_t x_stride, const uint8_t* w, int format,
                       const T* bias, int m, int k, int n, int x_bits);

// out[i, 0:K] = row rows[i] of W dequantized (i < count); rows are checked by the caller.
template <typename T>
void dequant_rows_cpu(T* out, int64_t out_stride, const uint8_t* w, int64_t w_row_bytes, int format,
                      const int64_t* rows, int64_t count, int k);

// The same from a grouped W (group_rows_cpu).
template <typename T>
void dequant_grouped_rows_cpu(T* out, int64_t out_stride, const uint8_t* w, int format, const int64_t* rows,
                              int64_t count, int k);

// Every block's scale (and min) finite: the index of the first row that has a non-finite one,
// or -1.
int64_t first_bad_row(const uint8_t* w, int64_t w_row_bytes, int format, int64_t n, int k);

}  // namespace quant
}  // namespace punica_x
