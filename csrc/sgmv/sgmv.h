// SGMV (segmented gather matrix-vector), Punica sec. 4: rows of one batch grouped into
// contiguous segments, segment s using its own LoRA weights.
//
// A launch covers `num_slices` projections that read the same input (e.g. q, k, v). For
// segment s the adapter stores, at w_ptr[s] (0 = no adapter, rows left untouched):
//   shrink: A_s with shape [L, R_s, h_in], R_s = sum_j ranks[s, j]  (A^T of every slice, stacked)
//   expand: B_s with shape [L, sum_j ranks[s, j] * h_out_j]          (slice j is [r_j, h_out_j])
// and the ops compute, for rows t in [seg[s], seg[s+1]):
//   shrink: v[t, 0:R_s]                        = x[t, :] @ A_s[layer]^T
//   expand: y[t, yoff_j : yoff_j + h_out_j]   += v[t, voff_j : voff_j + r_j] @ B_s,j[layer]
// with voff_j = sum_{i<j} r_i and yoff_j = sum_{i<j} h_out_i. v is always float32 (the bf16
// expand of the avx512_bf16 build reads it as two bf16 parts, hi + lo: expand_dot.h).
#pragma once

#include <cstdint>

namespace punica_x {

struct SgmvSegments {
  const int64_t* w_ptr;  // [num_segments] address of the adapter's weights, 0 for none
  const int32_t* ranks;  // [num_segments, num_slices] row-major
  const int32_t* seg;    // [num_segments + 1] first row of each segment
  int num_segments;
  int num_slices;
  int layer;
  // batch-invariant order (ModelConfig.batch_invariant): a row's result is the same bits
  // whatever its segment's size. Off, a bf16 segment of several rows may take other
  // arithmetic than a one-row segment (the avx512_bf16 build's dot tiles, AMX tiles); on,
  // every segment takes the one-row segment's arithmetic (the widening tiles for every bf16
  // segment on avx512_bf16, never the dot or AMX tiles; the dot tiles on one row were latency
  // bound, 1.3-2.0x the widening tile for 32 one-row segments on Zen 4, while the widening
  // tiles of several rows time as the dot tiles do at rank 16). CUDA: the shrink's split of K
  // is fixed by h_in alone (sgmv_cuda.cu).
  bool fixed_order = false;
};

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// CPU, multi-threaded with the caller's ATen thread pool. T (x and y): float or simd::bf16;
// W (the weights at w_ptr): T, or simd::bf16 with float x (LoraConfig.lora_dtype: adapters stored
// in half the bytes, widened as loaded). float32 accumulation, y rounded once per expand.
template <typename T, typename W = T>
void sgmv_shrink_cpu(float* v, int64_t v_stride, const T* x, int64_t x_stride, int h_in,
                     const SgmvSegments& p);
template <typename T, typename W = T>
void sgmv_expand_cpu(T* y, int64_t y_stride, const float* v, int64_t v_stride,
                     const int32_t* h_out, const SgmvSegments& p);

// CUDA (x, y and weights of `dtype`, v float32). The segment arrays live on the device;
// `max_rows` bounds the rows of any segment and `max_rank` bounds R_s (grid sizing).
// Shrink writes v[t, 0:R_s] for the rows of every segment with an adapter; where
// sgmv_shrink_accumulates says so (split-K with atomics: x not in 16-byte units) it adds into v,
// which the caller must zero first. Expand reads only what shrink wrote. Return false when `dtype` has no kernel.
bool sgmv_shrink_accumulates(DType dtype, int max_rows, int h_in, const void* x,
                             int64_t x_stride);
bool sgmv_shrink_cuda(DType dtype, float* v, int64_t v_stride, const void* x, int64_t x_stride,
                      int h_in, const SgmvSegments& p, int max_rows, int max_rank,
                      void* stream);
bool sgmv_expand_cuda(DType dtype, void* y, int64_t y_stride, const float* v, int64_t v_stride,
                      const int32_t* h_out_host, const SgmvSegments& p, int max_rows,
                      void* stream);

}  // namespace punica_x
