// Fused element-wise layers of the Llama block on the CPU, one pass over memory and one call
// from Python each, instead of 5-16 PyTorch ops. T: float or simd::bf16 (instantiated for
// both); statistics and arithmetic in float32.
#pragma once

#include <cstdint>

namespace punica_x {

// out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); rows of `hidden` values.
template <typename T>
void rms_norm_cpu(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* w, int64_t rows,
                  int hidden, float eps);

// residual[t] += x[t]; out[t] = rms_norm(residual[t]) (the residual stream of the next layer).
template <typename T>
void add_rms_norm_cpu(T* out, T* residual, const T* x, const T* w, int64_t rows, int hidden, float eps);

// Rotate-half RoPE in place on `heads` heads of `head_dim` per row, rows `stride` values apart:
// x' = x * cos[pos] + rotate_half(x) * sin[pos]; cos/sin: [max_pos, head_dim].
template <typename T>
void rope_cpu(T* x, int64_t stride, int64_t rows, int heads, int head_dim, const int64_t* positions,
              const T* cos, const T* sin);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i].
template <typename T>
void silu_and_mul_cpu(T* out, const T* gate_up, int64_t rows, int inter);

// out[t, i] = gelu_tanh(gate_up[t, i]) * gate_up[t, inter + i] (Gemma's gelu_pytorch_tanh:
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), computed as x / (1 + exp(-2 y))).
template <typename T>
void gelu_tanh_and_mul_cpu(T* out, const T* gate_up, int64_t rows, int inter);

}  // namespace punica_x
