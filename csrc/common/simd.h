// One hardware vector of floats for the CPU kernels, sized by the instruction set the
// extension is compiled for (PUNICA_X_CPU_ISA, see punica_x/ops/_build.py):
//   AVX-512: 16 floats (one zmm), 32 vector registers
//   AVX2   :  8 floats (one ymm), 16 vector registers
// Register tiles are sized from kLanes and kVecRegs, so a tile that fits AVX-512's 32 zmm
// registers is not compiled into one that spills on every FMA with AVX2's 16 ymm.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace punica_x {
namespace simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVecRegs = 32;
#if defined(PUNICA_X_EMULATE_AVX512)  // emulated_isa.h: a test build on an AVX2 CPU
constexpr const char* kIsa = PUNICA_X_EMULATE_AVX512 >= 2 ? "avx512_bf16_emulated" : "avx512_emulated";
#elif defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512_bf16";
#else
constexpr const char* kIsa = "avx512";
#endif
#elif defined(__AVX2__)
constexpr int kLanes = 8;
constexpr int kVecRegs = 16;
constexpr const char* kIsa = "avx2";
#else
constexpr int kLanes = 4;  // SSE / NEON width through GCC vector extensions
constexpr int kVecRegs = 16;
constexpr const char* kIsa = "generic";
#endif

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
// The same vector at float alignment: unaligned loads and stores straight to and from
// registers (memcpy made GCC bounce every accumulator of a tile through the stack).
typedef float vf_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }

inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

// A broadcast. `vf{} + s` would cost an extra scalar add per use (0 + s is not folded
// without -ffast-math); the intrinsic is a single vbroadcastss.
inline vf splat(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(s));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_set1_ps(s));
#else
  return vf{} + s;
#endif
}

// a * b + c rounded once. Written `c += a * b`, GCC contracts it into an FMA in some
// instantiations of a template and not in others (a peeled iteration of a one-row tile
// kept vmulps + vaddps, AVX2): a row's bits then depend on the tile it lands in, which the
// batch-invariant mode (punica_x/ops/invariance.py) cannot have.
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

typedef int vi __attribute__((vector_size(kLanes * sizeof(int))));
typedef unsigned vu __attribute__((vector_size(kLanes * sizeof(unsigned))));

// bfloat16 storage: the upper 16 bits of a float32. The kernels take float32 or bf16 tensors
// (weights, activations, KV) and always compute in float32: a bf16 vector is widened on load
// (zero-extend, shift: two cheap instructions on AVX2 and AVX-512) and rounded to nearest even
// on store, so bf16 halves the memory traffic on every x86 level, with or without AVX512-BF16.
struct bf16 {
  uint16_t bits;
};
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));

inline vf load(const bf16* p) {
#if defined(__AVX512F__)
  // one vpmovzxwd from memory and a shift; GCC lowers the generic conversion below at 16
  // lanes into two half-width loads, extracts and an insert (~2x the instructions)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(u);
#else
  const vu u = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16;
  return reinterpret_cast<const vf&>(u);
#endif
}

// Round to nearest even; a NaN stays a (quiet) NaN instead of rounding into infinity. The
// avx512_bf16 build uses the instruction (vcvtneps2bf16, the same rounding and NaN rule, one
// instruction for 16 values); it also turns float32 subnormals (|v| < 1.2e-38) into signed
// zeros, as vdpbf16ps reads bf16 subnormals, where the other builds keep a bf16 subnormal.
inline void store(bf16* p, vf v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
#else
  const vu u = reinterpret_cast<const vu&>(v);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (vu)(v != v);
  const vu out = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
  *reinterpret_cast<vh*>(p) = __builtin_convertvector(out, vh);
#endif
}

inline float f32(float x) { return x; }

inline float f32(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A float rounded to the storage type T (float: itself).
template <typename T>
inline T narrow(float x);

template <>
inline float narrow<float>(float x) {
  return x;
}

template <>
inline bf16 narrow<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (x != x) return bf16{uint16_t((u >> 16) | 0x40u)};
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

#if defined(__AVX512BF16__)
// AVX512-BF16 (the avx512_bf16 build): vdpbf16ps multiplies 32 bf16 pairs exactly and adds
// them into 16 float32 lanes, acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1]: twice the
// multiply-adds of an fp32 FMA per instruction, no widening. Products are exact (8-bit
// mantissas), sums are float32 with round-to-nearest-even; denormal inputs are read as zero.
constexpr bool kBf16Dot = true;
typedef __m512bh vbh;  // 32 bf16 values: 16 pairs

inline vbh load_pairs(const bf16* p) { return (vbh)_mm512_loadu_si512(p); }

// The first n (< 32) values, zeros after: a zero pair adds nothing.
inline vbh load_pairs(const bf16* p, int n) {
  return (vbh)_mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
}

// One pair (p[0], p[1]) in every lane (one 32-bit broadcast load); second = false takes
// (p[0], 0), an odd K's last value.
inline vbh splat_pair(const bf16* p, bool second = true) {
  uint32_t u = p[0].bits;
  if (second) std::memcpy(&u, p, sizeof u);
  return (vbh)_mm512_set1_epi32(int(u));
}

inline vf dot_pairs(vf acc, vbh a, vbh b) {
  return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), a, b));
}
#else
constexpr bool kBf16Dot = false;
#endif

// exp(x) per lane: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), a degree-6
// polynomial for exp(r) (Cephes expf), times 2^n built in the exponent bits. Within 2 ulp of
// std::exp; inputs are clamped to [-87.3, 88.7], so exp of a very negative x is ~1e-38, not 0.
inline vf exp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.7f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf shifter = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504f) + shifter) - shifter;
  const vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const vf y = p * r * r + r + splat(1.f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * reinterpret_cast<const vf&>(e);
}

// Tree reduction: halve the vector until 4 lanes are left, then (0 + 2) + (1 + 3) (a chain
// of scalar adds costs several times the latency). On AVX-512 and AVX2 the same tree in
// registers, always inlined: GCC called the array version out of line, through memory, once
// per accumulator, which cost a multi-row bf16 shrink tile over h_in = 576 as many
// instructions as its whole dot loop. Every version adds the same pairs in the same order,
// so the sums are the array version's to the bit (checked on every build when this changed).
#if defined(__AVX512F__) || defined(__AVX2__)
__attribute__((always_inline)) inline float hsum(vf v) {
#if defined(__AVX512F__)
  const __m512 z = reinterpret_cast<const __m512&>(v);
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(z),  // lane i + lane i + 8
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
  const __m256 t = reinterpret_cast<const __m256&>(v);
#endif
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // i + i + 4
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));  // (0 + 2), (1 + 3)
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}
#else
inline float hsum(vf v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(vf));
  for (int width = kLanes / 2; width >= 4; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}
#endif

}  // namespace simd
}  // namespace punica_x
