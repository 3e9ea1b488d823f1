// AVX-512 emulated in software on an AVX2 host, for tests only (punica_x/ops/isa.py's
// `*_emulated` levels): the kernels' avx512 (PUNICA_X_EMULATE_AVX512=1) or avx512_bf16 (=2)
// code paths compiled against SIMDe's portable implementations of the intrinsics (Debian's
// libsimde-dev, header-only), so that a CPU without AVX-512 runs those paths, slowly, and
// their tests (bit-exact batch invariance among them) hold for that code. Each intrinsic is
// one deterministic function of its inputs, as the instruction is: what a row's result
// depends on (which tiles and paths take it, in which order) is the build's own, though
// the emulated instructions' internal rounding (vdpbf16ps's) need not match the hardware's
// bit for bit.
//
// Included first in every translation unit (-include): SIMDe decides what is native before
// the __AVX512*__ macros below tell the kernels to take their AVX-512 paths.
#pragma once
#if !defined(PUNICA_X_EMULATE_AVX512)
#error "emulated_isa.h is for the *_emulated builds (PUNICA_X_EMULATE_AVX512=1 or 2)"
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <simde/x86/avx512.h>

// SIMDe 0.7.4's alias of _mm512_madd_epi16 takes the masked form's four arguments
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

// What SIMDe 0.7.4 lacks, element by element (masked loads and stores touch only the
// selected elements, as the instructions' fault suppression does)
// 16 lanes converted one by one: `in_t` lanes of a `arg_t` into `out_t` lanes of a `ret_t`
#define PUNICA_EMU_CONVERT(name, ret_t, arg_t, in_t, out_t) \
  static inline ret_t name(arg_t a) {                         \
    in_t in[16]; out_t out[16]; ret_t r;                      \
    memcpy(in, &a, sizeof in);                                \
    for (int i = 0; i < 16; i++) out[i] = (out_t)in[i];       \
    memcpy(&r, out, sizeof r); return r;                      \
  }
PUNICA_EMU_CONVERT(punica_emu_cvtepu16_epi32, simde__m512i, simde__m256i, uint16_t, int32_t)
PUNICA_EMU_CONVERT(punica_emu_cvtepu8_epi32, simde__m512i, simde__m128i, uint8_t, int32_t)
PUNICA_EMU_CONVERT(punica_emu_cvtepi8_epi32, simde__m512i, simde__m128i, int8_t, int32_t)
PUNICA_EMU_CONVERT(punica_emu_cvtepi32_ps, simde__m512, simde__m512i, int32_t, float)
static inline simde__m512i punica_emu_cvtps_epi32(simde__m512 a) {
  float in[16]; int32_t out[16]; simde__m512i r;
  memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; i++) {  // round to nearest even; out of range: INT32_MIN
    float v = nearbyintf(in[i]);
    out[i] = (v >= -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
  }
  memcpy(&r, out, sizeof r); return r;
}
static inline simde__m512 punica_emu_cvtph_ps(simde__m256i a) {
  __m128i lo, hi; __m256 flo, fhi; simde__m512 r;
  memcpy(&lo, &a, 16); memcpy(&hi, (const char*)&a + 16, 16);
  flo = _mm256_cvtph_ps(lo); fhi = _mm256_cvtph_ps(hi);
  memcpy(&r, &flo, 32); memcpy((char*)&r + 32, &fhi, 32); return r;
}
static inline simde__m256bh punica_emu_cvtneps_pbh(simde__m512 a) {
  uint32_t in[16]; uint16_t out[16]; simde__m256bh r;
  memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; i++) {  // round to nearest even, NaN stays NaN
    uint32_t u = in[i];
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                              : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  memcpy(&r, out, sizeof r); return r;
}
static inline float punica_emu_reduce_max_ps(simde__m512 a) {
  float in[16]; memcpy(in, &a, sizeof in);
  float m = in[0];
  for (int i = 1; i < 16; i++) m = in[i] > m ? in[i] : m;
  return m;
}
// `n` lanes of `elem_t` loaded where mask bit i is set, 0 elsewhere
#define PUNICA_EMU_MASKZ_LOAD(name, ret_t, mask_t, elem_t, n)                          \
  static inline ret_t name(mask_t k, const void* p) {                                  \
    elem_t out[n]; ret_t r;                                                            \
    for (int i = 0; i < n; i++) {                                                      \
      out[i] = 0;                                                                      \
      if (k >> i & 1) memcpy(&out[i], (const char*)p + sizeof(elem_t) * i, sizeof(elem_t)); \
    }                                                                                  \
    memcpy(&r, out, sizeof r); return r;                                               \
  }
PUNICA_EMU_MASKZ_LOAD(punica_emu_maskz_loadu_ps, simde__m512, uint16_t, float, 16)
PUNICA_EMU_MASKZ_LOAD(punica_emu_maskz_loadu_epi16, simde__m512i, uint32_t, uint16_t, 32)
PUNICA_EMU_MASKZ_LOAD(punica_emu_mm256_maskz_loadu_epi16, simde__m256i, uint16_t, uint16_t, 16)
static inline void punica_emu_mm256_mask_storeu_epi16(void* p, uint16_t k, simde__m256i a) {
  uint16_t in[16]; memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; i++)
    if (k >> i & 1) memcpy((char*)p + 2 * i, &in[i], 2);
}
#define _mm512_cvtepu16_epi32(a) punica_emu_cvtepu16_epi32(a)
#define _mm512_cvtepu8_epi32(a) punica_emu_cvtepu8_epi32(a)
#define _mm512_cvtepi8_epi32(a) punica_emu_cvtepi8_epi32(a)
#define _mm512_cvtepi32_ps(a) punica_emu_cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) punica_emu_cvtps_epi32(a)
#define _mm512_cvtph_ps(a) punica_emu_cvtph_ps(a)
#define _mm512_cvtneps_pbh(a) punica_emu_cvtneps_pbh(a)
#define _mm512_reduce_max_ps(a) punica_emu_reduce_max_ps(a)
#define _mm512_maskz_loadu_ps(k, p) punica_emu_maskz_loadu_ps(k, p)
#define _mm512_maskz_loadu_epi16(k, p) punica_emu_maskz_loadu_epi16(k, p)
#define _mm256_maskz_loadu_epi16(k, p) punica_emu_mm256_maskz_loadu_epi16(k, p)
#define _mm256_mask_storeu_epi16(p, k, a) punica_emu_mm256_mask_storeu_epi16(p, k, a)

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512CD__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#if PUNICA_X_EMULATE_AVX512 >= 2
#define __AVX512BF16__ 1
#define __AVX512VNNI__ 1
#endif
