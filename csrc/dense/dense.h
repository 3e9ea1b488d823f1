// Dense projections of the shared backbone on the CPU: y[M, N] = x[M, K] @ W[K, N] with W
// stored panel-major, [ceil(N / kPanel)][K][kPanel] (the last panel zero-padded), so a panel
// streams contiguously and stays in L2 while every block of rows reuses it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/prefetch.h"
#include "../common/simd.h"

namespace punica_x {

#ifndef PUNICA_X_DENSE_NB
#define PUNICA_X_DENSE_NB 3
#endif
// Output columns per panel: 3 vectors (48 floats on AVX-512, 24 on AVX2).
constexpr int kDenseVecs = PUNICA_X_DENSE_NB;
constexpr int kDensePanel = kDenseVecs * simd::kLanes;

// K values stored side by side in a packed row: 2 for bf16 on the avx512_bf16 build (the pair
// vdpbf16ps multiplies into one float32 lane; an odd K's last pair is (w, 0)), else 1.
template <typename T>
constexpr int kDenseKPack = std::is_same_v<T, simd::bf16> && simd::kBf16Dot ? 2 : 1;

// Packed layout: [ceil(N / kDensePanel)][ceil(K / KP)][kDensePanel][KP], KP = kDenseKPack<T>.
template <typename T>
constexpr int64_t dense_packed_rows(int64_t k) {
  return (k + kDenseKPack<T> - 1) / kDenseKPack<T>;
}

// T: float or simd::bf16 for every operand (instantiated for both); float32 accumulation. A
// bf16 panel is half the bytes, so the memory-bound decode GEMM streams half as much.
// packed must hold ceil(n / kDensePanel) * dense_packed_rows<T>(k) * kDensePanel * KP values.
template <typename T>
void dense_pack_cpu(T* packed, const T* w, int64_t w_row_stride, int k, int n, bool w_is_out_by_in);

// y[m, 0:n] = x[m, 0:k] @ W (+ bias[0:n] when bias is not null). `prefetch`: regions another
// kernel reads next, pulled into L2 a few lines per K step while the tiles compute (none: {}).
template <typename T>
void dense_gemm_cpu(T* y, int64_t y_stride, const T* x, int64_t x_stride, const T* packed, const T* bias,
                    int m, int k, int n, const PrefetchSpans& prefetch = {});

}  // namespace punica_x
