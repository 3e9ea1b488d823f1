// Fused element-wise layers of the Llama block on the CPU (float32), one pass over memory and
// one call from Python each, instead of 5-16 PyTorch ops.
#pragma once

#include <cstdint>

namespace punica_x {

// out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); rows of `hidden` floats.
void rms_norm_cpu(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* w,
                  int64_t rows, int hidden, float eps);

// residual[t] += x[t]; out[t] = rms_norm(residual[t]) (the residual stream of the next layer).
void add_rms_norm_cpu(float* out, float* residual, const float* x, const float* w, int64_t rows,
                      int hidden, float eps);

// Rotate-half RoPE in place on `heads` heads of `head_dim` per row, rows `stride` floats apart:
// x' = x * cos[pos] + rotate_half(x) * sin[pos]; cos/sin: [max_pos, head_dim].
void rope_cpu(float* x, int64_t stride, int64_t rows, int heads, int head_dim, const int64_t* positions,
              const float* cos, const float* sin);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i].
void silu_and_mul_cpu(float* out, const float* gate_up, int64_t rows, int inter);

}  // namespace punica_x
