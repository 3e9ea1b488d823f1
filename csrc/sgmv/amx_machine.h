// The AMX tile machine behind amx.h: whether this CPU and OS give tiles (a probe) and the
// permission request, the settings, tile configurations (one per thread, launch phase and row
// count), and the instructions, on hardware or emulated on scalar tiles for machines without
// AMX (tests). Defines PUNICA_X_AMX on the avx512_bf16 build.
#pragma once

#if defined(__AVX512BF16__) && defined(__x86_64__)
#define PUNICA_X_AMX 1

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "../common/simd.h"

namespace punica_x {
namespace amx {

using simd::bf16;

enum Mode : int { kOff = 0, kHardware = 1, kEmulated = 2 };
constexpr int kDefaultMinRows = 8;  // segments of at least this many rows run on tiles
// (C0..C3 hold an item's sums: at most 64 rank rows (shrink) or columns (expand) an item.)

// CPUID says AMX-TILE and AMX-BF16, the OS enabled tile state, and Linux can grant tile data
// (ARCH_GET_XCOMP_SUPP lists XTILEDATA). A probe: it asks the kernel for nothing, so checking
// (a test's skip condition, a start-up check) leaves the process as it was.
inline bool hardware_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA enabled
    constexpr long kGetXcompSupp = 0x1021;
    unsigned long long features = 0;
    return syscall(SYS_arch_prctl, kGetXcompSupp, &features) == 0 && ((features >> 18) & 1u);
  }();
  return ok;
}

// Asks Linux to let this process use tile data (ARCH_REQ_XCOMP_PERM for XTILEDATA; a no-op if
// oneDNN already asked), once, when the hardware mode is turned on and not before: from then
// on every thread's signal frames carry the 8 KB of tile state. (On the lent AMX host, a C++
// exception thrown from this extension crashed the process with or without tiles, also in a
// process that never asked for them: that crash is not this request's; 2026-11-26.)
inline bool hardware_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return hardware_supported() && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Off until the module's loader sets it (punica_x/ops/amx_tiles.py: PUNICA_X_SGMV_AMX, on by
// default where there are tiles), or the binding's sgmv_amx.
struct Settings {
  std::atomic<int> mode{kOff};
  std::atomic<int> min_rows{kDefaultMinRows};
  std::atomic<int64_t> items{0};    // items run on tiles since the process started (for tests)
  std::atomic<int64_t> configs{0};  // tile configurations loaded (for tests)
  std::atomic<int64_t> phases{0};   // launch phases that planned tile items: their ids
};

inline Settings& settings() {
  static Settings s;
  return s;
}

inline int mode() { return settings().mode.load(std::memory_order_relaxed); }

// Whether a bf16 segment of `rows` rows suits tiles (h_in: the shrink's width, 0 for expand),
// the mode aside.
inline bool takes(int rows, int h_in) {
  return rows >= settings().min_rows.load(std::memory_order_relaxed) && h_in % 32 == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Sums and left operand: `rows` rows; right operands: 16 rows; every row 64 bytes.
inline TileConfig config_for(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = uint8_t(t < 5 ? rows : 16);
  }
  return c;
}

// A new id for a launch phase (a shrink or an expand) that has tile items.
inline int64_t new_phase() { return settings().phases.fetch_add(1, std::memory_order_relaxed) + 1; }

// What this thread's tiles (of kind Tiles) hold: the configuration for `rows` rows, loaded in
// phase `phase` (0: none). Another phase reconfigures, since oneDNN may have run between.
struct TileState {
  int64_t phase = 0;
  int rows = 0;
};

template <class Tiles>
TileState& tile_state() {
  thread_local TileState s;
  return s;
}

// Loads the configuration for `rows` rows unless this thread holds it from this phase already.
template <class Tiles>
void configure(int64_t phase, int rows) {
  TileState& s = tile_state<Tiles>();
  if (s.phase == phase && s.rows == rows) return;
  const TileConfig cfg = config_for(rows);
  Tiles::config(&cfg);
  settings().configs.fetch_add(1, std::memory_order_relaxed);
  s = {phase, rows};
}

// Releases this thread's tiles if it configured them in `phase` (a thread that ran no tile
// item of the phase touches no tile instruction).
template <class Tiles>
void release(int64_t phase) {
  TileState& s = tile_state<Tiles>();
  if (s.phase != phase) return;
  Tiles::release();
  s = {};
}

struct Hardware {
  static void config(const TileConfig* c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c)); }
  static void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(long(stride)), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(long(stride)), "i"(T) : "memory");
  }
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int C, int A, int B>
  static void dp() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

// The instructions' semantics on scalar tiles (thread-local), for tests on machines without AMX.
struct Emulated {
  struct State {
    TileConfig cfg;
    alignas(64) uint8_t t[8][16][64];
  };
  static State& st() {
    thread_local State s;
    return s;
  }
  static void config(const TileConfig* c) {
    st().cfg = *c;
    std::memset(st().t, 0, sizeof(st().t));
  }
  static void release() {}
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& s = st();
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(s.t[T][r], static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    State& s = st();
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }
  template <int T>
  static void zero() {
    std::memset(st().t[T], 0, sizeof(st().t[T]));
  }
  template <int C, int A, int B>
  static void dp() {
    State& s = st();
    auto bf = [](const uint8_t* row, int i) {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return simd::f32(bf16{h});
    };
    const int k_pairs = s.cfg.colsb[A] / 4;
    for (int m = 0; m < s.cfg.rows[C]; ++m)
      for (int n = 0; n < s.cfg.colsb[C] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s.t[C][m] + 4 * n, 4);
        for (int k = 0; k < k_pairs; ++k)
          acc += bf(s.t[A][m], 2 * k) * bf(s.t[B][k], 2 * n) +
                 bf(s.t[A][m], 2 * k + 1) * bf(s.t[B][k], 2 * n + 1);
        std::memcpy(s.t[C][m] + 4 * n, &acc, 4);
      }
  }
};

// fn(Hardware{}) or fn(Emulated{}), by `mode` (mode() when the launch planned its items)
template <typename F>
void with_tiles(int mode, const F& fn) {
  if (mode == kHardware)
    fn(Hardware{});
  else
    fn(Emulated{});
}

}  // namespace amx
}  // namespace punica_x

#endif  // __AVX512BF16__ && __x86_64__
