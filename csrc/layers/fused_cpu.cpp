// Fused element-wise layers (see fused.h). The arithmetic follows the PyTorch reference step
// by step (float32 statistics, the same operation order) so results agree to rounding.
#include <cmath>

#include "../common/parallel.h"
#include "../common/simd.h"
#include "fused.h"

namespace punica_x {
namespace {

constexpr int64_t kRowsPerItem = 4;  // rows per work item: enough work to amortise the pull

inline float inv_rms(const float* x, int hidden, float eps) {
  double acc = 0.0;  // the mean of squares, accumulated wider than the data
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < hidden; ++i) acc += double(x[i]) * double(x[i]);
  return 1.f / std::sqrt(float(acc / hidden) + eps);
}

template <typename F>
void rows_parallel(int64_t rows, const F& fn) {
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  parallel_items(items, [&](int64_t item) {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t t = item * kRowsPerItem; t < end; ++t) fn(t);
  });
}

}  // namespace

void rms_norm_cpu(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t rows,
                  int hidden, float eps) {
  rows_parallel(rows, [&](int64_t t) {
    const float* xr = x + t * xs;
    float* o = out + t * os;
    const float inv = inv_rms(xr, hidden, eps);
#pragma omp simd
    for (int i = 0; i < hidden; ++i) o[i] = w[i] * (xr[i] * inv);
  });
}

void add_rms_norm_cpu(float* out, float* residual, const float* x, const float* w, int64_t rows,
                      int hidden, float eps) {
  rows_parallel(rows, [&](int64_t t) {
    float* r = residual + t * hidden;
    const float* xr = x + t * hidden;
#pragma omp simd
    for (int i = 0; i < hidden; ++i) r[i] = r[i] + xr[i];
    const float inv = inv_rms(r, hidden, eps);
    float* o = out + t * hidden;
#pragma omp simd
    for (int i = 0; i < hidden; ++i) o[i] = w[i] * (r[i] * inv);
  });
}

void rope_cpu(float* x, int64_t stride, int64_t rows, int heads, int head_dim, const int64_t* positions,
              const float* cos, const float* sin) {
  const int half = head_dim / 2;
  rows_parallel(rows, [&](int64_t t) {
    const float* c = cos + positions[t] * head_dim;
    const float* s = sin + positions[t] * head_dim;
    for (int h = 0; h < heads; ++h) {
      float* v = x + t * stride + int64_t(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        const float a = x1 * c[i], b = -x2 * s[i];  // q * cos, rotate_half(q) * sin
        const float d = x2 * c[i + half], e = x1 * s[i + half];
        v[i] = a + b;
        v[i + half] = d + e;
      }
    }
  });
}

void silu_and_mul_cpu(float* out, const float* gate_up, int64_t rows, int inter) {
  rows_parallel(rows, [&](int64_t t) {
    const float* g = gate_up + t * 2 * int64_t(inter);
    const float* u = g + inter;
    float* o = out + t * inter;
    int i = 0;
    for (; i + simd::kLanes <= inter; i += simd::kLanes) {
      const simd::vf gv = simd::load(g + i);
      simd::store(o + i, gv / (simd::splat(1.f) + simd::exp(-gv)) * simd::load(u + i));
    }
    for (; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
}

}  // namespace punica_x
