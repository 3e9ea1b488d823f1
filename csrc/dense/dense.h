// Dense projections of the shared backbone on the CPU: y[M, N] = x[M, K] @ W[K, N] with W
// stored panel-major, [ceil(N / kPanel)][K][kPanel] (the last panel zero-padded), so a panel
// streams contiguously and stays in L2 while every block of rows reuses it.
#pragma once

#include <cstdint>

namespace punica_x {

constexpr int kDensePanel = 48;  // output columns per panel: 3 vectors of 16 floats

// packed must hold ceil(n / kDensePanel) * k * kDensePanel floats.
void dense_pack_cpu(float* packed, const float* w, int64_t w_row_stride, int k, int n, bool w_is_out_by_in);

// y[m, 0:n] = x[m, 0:k] @ W (+ bias[0:n] when bias is not null).
void dense_gemm_cpu(float* y, int64_t y_stride, const float* x, int64_t x_stride, const float* packed,
                    const float* bias, int m, int k, int n);

}  // namespace punica_x
