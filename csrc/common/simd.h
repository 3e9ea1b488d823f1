// 16-float vectors for the CPU kernels: one AVX-512 register (two AVX2 registers elsewhere,
// through GCC vector extensions), with the few operations the kernels need.
#pragma once

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace punica_x {
namespace simd {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(vf));
  return r;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

// A broadcast. `vf{} + s` would cost an extra scalar add per use (0 + s is not folded
// without -ffast-math); the intrinsic is a single vbroadcastss.
inline vf splat(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(s));
#else
  return vf{} + s;
#endif
}

// Tree reduction: a chain of 16 scalar adds costs ~4x more latency.
inline float hsum(vf v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, sizeof(vf8));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(vf8), sizeof(vf8));
  const vf8 s8 = lo + hi;
  vf4 a, b;
  std::memcpy(&a, &s8, sizeof(vf4));
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof(vf4), sizeof(vf4));
  const vf4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

}  // namespace simd
}  // namespace punica_x
