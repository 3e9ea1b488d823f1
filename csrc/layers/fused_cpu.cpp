// Fused element-wise layers (see fused.h). The arithmetic follows the PyTorch reference step
// by step (float32 statistics, the same operation order) so results agree to rounding. T is
// float or simd::bf16: values are widened to float32, computed, and rounded once on store.
#include <cmath>
#include <type_traits>

#include "../common/parallel.h"
#include "../common/simd.h"
#include "fused.h"

namespace punica_x {
namespace {

using simd::bf16;
using simd::f32;
using simd::kLanes;
using simd::narrow;
using simd::vf;

constexpr int64_t kRowsPerItem = 4;  // rows per work item: enough work to amortise the pull

template <typename T>
inline float inv_rms(const T* x, int hidden, float eps) {
  double acc = 0.0;  // the mean of squares, accumulated wider than the data
  int i = 0;
  if constexpr (!std::is_same_v<T, float>) {
    // a bf16 value squared is exact in float32 (8-bit mantissas), so only the sum needs
    // doubles: widen a vector, square it, accumulate its lanes as doubles
    typedef double vd __attribute__((vector_size(kLanes * sizeof(double))));
    vd sum = {};
    for (; i + kLanes <= hidden; i += kLanes) {
      const vf v = simd::load(x + i);
      sum += __builtin_convertvector(v * v, vd);
    }
    for (int l = 0; l < kLanes; ++l) acc += sum[l];
  }
#pragma omp simd reduction(+ : acc)
  for (int j = i; j < hidden; ++j) acc += double(f32(x[j])) * double(f32(x[j]));
  return 1.f / std::sqrt(float(acc / hidden) + eps);
}

// o[i] = w[i] * round_T(x[i] * inv): the reference rounds the normalised row to the data type
// before the weight multiplies it.
template <typename T>
inline void scale_row(T* o, const T* x, const T* w, float inv, int hidden) {
  int i = 0;
  const vf iv = simd::splat(inv);
  for (; i + kLanes <= hidden; i += kLanes) {
    vf h = simd::load(x + i) * iv;
    if constexpr (!std::is_same_v<T, float>) {  // round to T as the reference does
      T tmp[kLanes];
      simd::store(tmp, h);
      h = simd::load(tmp);
    }
    simd::store(o + i, simd::load(w + i) * h);
  }
  for (; i < hidden; ++i) o[i] = narrow<T>(f32(w[i]) * f32(narrow<T>(f32(x[i]) * inv)));
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

template <typename T>
void rms_norm_cpu(T* out, int64_t os, const T* x, int64_t xs, const T* w, int64_t rows, int hidden,
                  float eps) {
  rows_parallel(rows, [&](int64_t t) {
    const T* xr = x + t * xs;
    scale_row(out + t * os, xr, w, inv_rms(xr, hidden, eps), hidden);
  });
}

template <typename T>
void add_rms_norm_cpu(T* out, T* residual, const T* x, const T* w, int64_t rows, int hidden,
                      float eps) {
  rows_parallel(rows, [&](int64_t t) {
    T* r = residual + t * hidden;
    const T* xr = x + t * hidden;
    int i = 0;
    for (; i + kLanes <= hidden; i += kLanes) simd::store(r + i, simd::load(r + i) + simd::load(xr + i));
    for (; i < hidden; ++i) r[i] = narrow<T>(f32(r[i]) + f32(xr[i]));
    scale_row(out + t * hidden, r, w, inv_rms(r, hidden, eps), hidden);
  });
}

template <typename T>
void rope_cpu(T* x, int64_t stride, int64_t rows, int heads, int head_dim, const int64_t* positions,
              const T* cos, const T* sin) {
  const int half = head_dim / 2;
  rows_parallel(rows, [&](int64_t t) {
    const T* c = cos + positions[t] * head_dim;
    const T* s = sin + positions[t] * head_dim;
    for (int h = 0; h < heads; ++h) {
      T* v = x + t * stride + int64_t(h) * head_dim;
      int i = 0;
      for (; i + kLanes <= half; i += kLanes) {  // the same arithmetic, a vector at a time
        const vf x1 = simd::load(v + i), x2 = simd::load(v + i + half);
        const vf a = x1 * simd::load(c + i), b = -x2 * simd::load(s + i);
        const vf d = x2 * simd::load(c + i + half), e = x1 * simd::load(s + i + half);
        simd::store(v + i, a + b);
        simd::store(v + i + half, d + e);
      }
      for (; i < half; ++i) {
        const float x1 = f32(v[i]), x2 = f32(v[i + half]);
        const float a = x1 * f32(c[i]), b = -x2 * f32(s[i]);  // q * cos, rotate_half(q) * sin
        const float d = x2 * f32(c[i + half]), e = x1 * f32(s[i + half]);
        v[i] = narrow<T>(a + b);
        v[i + half] = narrow<T>(d + e);
      }
    }
  });
}

// out[t, i] = gate * sigmoid(-z(gate)) * up = gate / (1 + exp(z(gate))) * up over [T, 2 I]:
// SiLU (z = -x) and GeLU-tanh (z = -2 sqrt(2/pi) (x + 0.044715 x^3)); zv on vectors, zs on
// the scalar tail.
template <typename T, typename ZV, typename ZS>
void sigmoid_gate_and_mul(T* out, const T* gate_up, int64_t rows, int inter, ZV zv, ZS zs) {
  rows_parallel(rows, [&](int64_t t) {
    const T* g = gate_up + t * 2 * int64_t(inter);
    const T* u = g + inter;
    T* o = out + t * inter;
    int i = 0;
    for (; i + kLanes <= inter; i += kLanes) {
      const vf x = simd::load(g + i);
      simd::store(o + i, x / (simd::splat(1.f) + simd::exp(zv(x))) * simd::load(u + i));
    }
    for (; i < inter; ++i) {
      const float x = f32(g[i]);
      o[i] = narrow<T>(x / (1.f + std::exp(zs(x))) * f32(u[i]));
    }
  });
}

template <typename T>
void silu_and_mul_cpu(T* out, const T* gate_up, int64_t rows, int inter) {
  sigmoid_gate_and_mul(out, gate_up, rows, inter, [](vf x) { return -x; }, [](float x) { return -x; });
}

template <typename T>
void gelu_tanh_and_mul_cpu(T* out, const T* gate_up, int64_t rows, int inter) {
  constexpr float k2 = 2.f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  constexpr float c = 0.044715f;
  sigmoid_gate_and_mul(
      out, gate_up, rows, inter,
      [](vf x) { return x * (simd::splat(1.f) + simd::splat(c) * x * x) * simd::splat(-k2); },
      [](float x) { return -k2 * x * (1.f + c * x * x); });
}

#define PUNICA_X_FUSED_INSTANTIATE(T)                                                           \
  template void rms_norm_cpu<T>(T*, int64_t, const T*, int64_t, const T*, int64_t, int, float); \
  template void add_rms_norm_cpu<T>(T*, T*, const T*, const T*, int64_t, int, float);           \
  template void rope_cpu<T>(T*, int64_t, int64_t, int, int, const int64_t*, const T*, const T*); \
  template void silu_and_mul_cpu<T>(T*, const T*, int64_t, int);                              \
  template void gelu_tanh_and_mul_cpu<T>(T*, const T*, int64_t, int);
PUNICA_X_FUSED_INSTANTIATE(float)
PUNICA_X_FUSED_INSTANTIATE(bf16)

}  // namespace punica_x
