// SGMV on AMX tiles (AMX-BF16: Intel Xeon 4th generation and later) for bf16 segments of
// several rows, on the avx512_bf16 build. One tdpbf16ps multiplies a 16 x 32 bf16 tile by a
// 32 x 16 one into 16 x 16 float32 sums (16 x 16 x 32 multiply-adds per instruction, 32 for
// vdpbf16ps), so a segment of many rows (one adapter for the whole batch, issue 29's
// Identical) costs its tiles' loads, not its multiply-adds. One-row segments stay on the
// vector kernels: they are bound by reading the weights, which tiles do not change.
//
// shrink: v[m, j] = x[m, :] . A^T[j, :] as C = X @ P. X: up to 16 rows of x, 32 of h_in per
//         tile, loaded as stored. P: 16 rank rows of A^T, transposed into the tile's pair
//         layout (row p holds (A^T[j, 2p], A^T[j, 2p + 1]) for 16 j) by 16 x 16 dword
//         transposes, once per item. h_in must be a multiple of 32.
// expand: y[m, c] += v[m, :r] @ B[:r, c] as C = V @ Q. V: v split into hi and lo bf16 parts
//         (as expand_dot.h does, so the products keep float32 v's precision) in chunks of 16
//         rank rows, [hi(16) | lo(16)] per row and chunk. Q: the chunk's B rows in pairs
//         (B[2i, c], B[2i + 1, c]), twice (rows 0..7 meet hi, 8..15 lo). y is rounded once.
// Sums are float32 in the tiles' own order, so results differ from the vector kernels' in
// float32 rounding only (tests/punica_x/ops/test_sgmv_amx.py compares both to the reference).
//
// Tiles: C0..C3 = tmm0..3 (sums), tmm4 the left operand, tmm5..7 right operands in turn. A
// thread loads a tile configuration once per launch phase and row count (configure: the items
// of a phase reuse it) and releases the tiles when its last item of the phase is done
// (release), so oneDNN's AMX GEMMs, which configure the same threads for themselves, find
// them released. `Emulated` runs the same code on any avx512_bf16 machine with
// scalar tiles, so the packing and indexing are tested where there is no AMX.
#pragma once

#include "amx_machine.h"

#if defined(PUNICA_X_AMX)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/simd.h"
#include "expand_dot.h"

namespace punica_x {
namespace amx {

using simd::bf16;

// out[c * 16 + r] = in[r * in_stride + c] for 16 x 16 dwords (rows r, columns c).
inline void transpose16(uint32_t* out, const __m512i* rows) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  // b[4i + q], 128-bit lane L: column 4L + q of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i s0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xEE);
    _mm512_storeu_si512(out + (q)*16, _mm512_shuffle_i32x4(s0, s2, 0x88));
    _mm512_storeu_si512(out + (4 + q) * 16, _mm512_shuffle_i32x4(s0, s2, 0xDD));
    _mm512_storeu_si512(out + (8 + q) * 16, _mm512_shuffle_i32x4(s1, s3, 0x88));
    _mm512_storeu_si512(out + (12 + q) * 16, _mm512_shuffle_i32x4(s1, s3, 0xDD));
  }
}

// The shrink's right operands: for rank block t (16 rows of a, jn in all) and K block kb (32 of
// h_in), 16 x 16 dwords at pack[(t * kbs + kb) * 256]: row p, column j = the pair
// (a[16t + j, 32kb + 2p], a[16t + j, 32kb + 2p + 1]); rows past jn are zero.
inline void pack_shrink(uint32_t* pack, const bf16* a, int jn, int h_in) {
  const int kbs = h_in / 32;
  for (int t = 0; t * 16 < jn; ++t)
    for (int kb = 0; kb < kbs; ++kb) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = 16 * t + j < jn ? _mm512_loadu_si512(a + int64_t(16 * t + j) * h_in + 32 * kb)
                                  : _mm512_setzero_si512();
      transpose16(pack + (int64_t(t) * kbs + kb) * 256, rows);
    }
}

// One K step: tmm4 holds the left operand; right operand t (from `at(t)`, 16 rows of 64 bytes)
// is multiplied into C_t, for t < n; the right operands rotate over tmm5..7.
template <class Tiles, class At>
inline void sum_block(int nt, const At& at) {
  Tiles::template load<5>(at(0), 64);
  Tiles::template dp<0, 4, 5>();
  if (nt > 1) {
    Tiles::template load<6>(at(1), 64);
    Tiles::template dp<1, 4, 6>();
  }
  if (nt > 2) {
    Tiles::template load<7>(at(2), 64);
    Tiles::template dp<2, 4, 7>();
  }
  if (nt > 3) {
    Tiles::template load<5>(at(3), 64);
    Tiles::template dp<3, 4, 5>();
  }
}

// each(t, sums) for t < n, sums: C_t stored as 16 rows of 16 floats.
template <class Tiles, class F>
inline void store_sums(int n, const F& each) {
  alignas(64) float tmp[16 * 16];
  auto one = [&](auto tile, int t) {
    Tiles::template store<decltype(tile)::value>(tmp, 64);
    each(t, tmp);
  };
  one(std::integral_constant<int, 0>{}, 0);
  if (n > 1) one(std::integral_constant<int, 1>{}, 1);
  if (n > 2) one(std::integral_constant<int, 2>{}, 2);
  if (n > 3) one(std::integral_constant<int, 3>{}, 3);
}

template <class Tiles>
inline void zero_sums() {
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  Tiles::template zero<3>();
}

// v[m, j] = x[m, :] . a[j, :] for m < rows, j < jn <= 64; a: jn rows of A^T, h_in long
// (h_in % 32 == 0); x rows xs apart, v rows vs apart (floats).
// Runs in launch phase `phase` (configure); the caller releases the tiles after the phase.
template <class Tiles>
void shrink(int64_t phase, float* v, int64_t vs, const bf16* x, int64_t xs, int rows, const bf16* a,
            int jn, int h_in) {
  settings().items.fetch_add(1, std::memory_order_relaxed);
  const int kbs = h_in / 32, nt = (jn + 15) / 16;
  thread_local std::vector<uint32_t> pack;
  if (pack.size() < size_t(nt) * kbs * 256) pack.resize(size_t(nt) * kbs * 256);
  pack_shrink(pack.data(), a, jn, h_in);
  for (int m0 = 0; m0 < rows; m0 += 16) {
    const int mb = std::min(16, rows - m0);
    configure<Tiles>(phase, mb);
    zero_sums<Tiles>();
    for (int kb = 0; kb < kbs; ++kb) {
      Tiles::template load<4>(x + int64_t(m0) * xs + 32 * kb, xs * int64_t(sizeof(bf16)));
      sum_block<Tiles>(nt, [&](int t) { return pack.data() + (int64_t(t) * kbs + kb) * 256; });
    }
    store_sums<Tiles>(nt, [&](int t, const float* tmp) {
      const int cols = std::min(16, jn - 16 * t);
      for (int m = 0; m < mb; ++m)
        std::memcpy(v + (m0 + m) * vs + 16 * t, tmp + 16 * m, cols * sizeof(float));
    });
  }
}

// Chunks of 16 rank rows a split v row takes: [hi(16) | lo(16)] bf16 per chunk.
inline int chunks(int r) { return (r + 15) / 16; }

// dst[rows][chunks(r)][32] = v[rows, 0:r] (rows vs apart) as hi = bf16(v), lo = bf16(v - hi),
// zero past r (expand_dot.h's split, in chunks of 16).
inline void split_chunks(bf16* dst, const float* v, int64_t vs, int rows, int r) {
  const int nc = chunks(r);
  for (int m = 0; m < rows; ++m)
    for (int c = 0; c < nc; ++c) {
      bf16* out = dst + (int64_t(m) * nc + c) * 32;
      expand_dot::split16(out, out + 16, v + m * vs + 16 * c, std::min(16, r - 16 * c), true);
    }
}

// The expand's right operands: for chunk c and column block nb (16 of cols), 16 x 16 dwords at
// pack[(c * nbs + nb) * 256]: row i < 8 and row 8 + i hold the pairs (b[16c + 2i, 16nb + n],
// b[16c + 2i + 1, 16nb + n]); rank rows past r and columns past cols are zero.
inline void pack_expand(uint32_t* pack, const bf16* b, int64_t ld, int r, int cols) {
  const int nbs = (cols + 15) / 16;
  auto row = [&](int i, int nb, __mmask16 mask) {
    if (i >= r) return _mm512_setzero_si512();
    const __m256i h = _mm256_maskz_loadu_epi16(mask, b + int64_t(i) * ld + 16 * nb);
    return _mm512_cvtepu16_epi32(h);
  };
  for (int c = 0; c < chunks(r); ++c)
    for (int nb = 0; nb < nbs; ++nb) {
      const __mmask16 mask = __mmask16((1u << std::min(16, cols - 16 * nb)) - 1);
      uint32_t* out = pack + (int64_t(c) * nbs + nb) * 256;
      for (int i = 0; i < 8; ++i) {
        const int i0 = 16 * c + 2 * i;
        const __m512i pair = _mm512_or_si512(row(i0, nb, mask), _mm512_slli_epi32(row(i0 + 1, nb, mask), 16));
        _mm512_storeu_si512(out + i * 16, pair);
        _mm512_storeu_si512(out + (8 + i) * 16, pair);
      }
    }
}

// y[m, c] += v[m, :r] @ b[:r, c] for m < rows, c < cols <= 64; vsplit: split_chunks(v) rows;
// b rows ld apart, y rows ys apart; y rounded once (round to nearest even). Runs in launch
// phase `phase` (configure); the caller releases the tiles after the phase.
template <class Tiles>
void expand(int64_t phase, bf16* y, int64_t ys, const bf16* vsplit, int rows, int r, const bf16* b,
            int64_t ld, int cols) {
  settings().items.fetch_add(1, std::memory_order_relaxed);
  const int nc = chunks(r), nbs = (cols + 15) / 16;
  thread_local std::vector<uint32_t> pack;
  if (pack.size() < size_t(nc) * nbs * 256) pack.resize(size_t(nc) * nbs * 256);
  pack_expand(pack.data(), b, ld, r, cols);
  const int64_t vrow = int64_t(nc) * 32 * sizeof(bf16);  // bytes per split v row
  for (int m0 = 0; m0 < rows; m0 += 16) {
    const int mb = std::min(16, rows - m0);
    configure<Tiles>(phase, mb);
    zero_sums<Tiles>();
    for (int c = 0; c < nc; ++c) {
      Tiles::template load<4>(vsplit + (int64_t(m0) * nc + c) * 32, vrow);
      sum_block<Tiles>(nbs, [&](int nb) { return pack.data() + (int64_t(c) * nbs + nb) * 256; });
    }
    store_sums<Tiles>(nbs, [&](int nb, const float* tmp) {
      const __mmask16 mask = __mmask16((1u << std::min(16, cols - 16 * nb)) - 1);
      for (int m = 0; m < mb; ++m) {
        bf16* yp = y + (m0 + m) * ys + 16 * nb;
        const __m256i h = _mm256_maskz_loadu_epi16(mask, yp);
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        const __m512 sum = _mm512_add_ps(f, _mm512_loadu_ps(tmp + 16 * m));
        _mm256_mask_storeu_epi16(yp, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
      }
    });
  }
}

}  // namespace amx
}  // namespace punica_x

#endif  // PUNICA_X_AMX

#include <type_traits>

#include "../common/simd.h"

namespace punica_x {
namespace amx {

// amx::mode() for bf16 on the avx512_bf16 build, else 0 (off); a launch reads it once.
template <typename T>
int tiles_mode() {
#if defined(PUNICA_X_AMX)
  if constexpr (std::is_same_v<T, simd::bf16>) return mode();
#endif
  return 0;
}

// Whether a segment of `rows` rows runs on tiles in `mode` (h_in: the shrink's, 0 for expand).
inline bool on_tiles(int mode, int rows, int h_in) {
#if defined(PUNICA_X_AMX)
  return mode != kOff && takes(rows, h_in);
#else
  return (void)mode, (void)rows, (void)h_in, false;
#endif
}

// The id of a launch phase (a shrink or an expand) in `mode`: 0 when off (no tile item runs).
inline int64_t phase_for(int mode) {
#if defined(PUNICA_X_AMX)
  return mode != kOff ? new_phase() : 0;
#else
  return (void)mode, 0;
#endif
}

// After a thread's last item of phase `phase`: releases its tiles if it configured them.
inline void end_phase(int mode, int64_t phase) {
#if defined(PUNICA_X_AMX)
  if (phase != 0) with_tiles(mode, [&](auto tiles) { release<decltype(tiles)>(phase); });
#else
  (void)mode, (void)phase;
#endif
}

}  // namespace amx
}  // namespace punica_x
