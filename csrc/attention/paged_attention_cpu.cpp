// CPU paged attention: one work item = (sequence, KV head, block of up to 4 query rows); the
// G query heads sharing that KV head and the rows of the block read each K/V block while it
// is hot in L1. Online softmax per (row, head) updated once per KV block, float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/parallel.h"
#include "../common/simd.h"
#include "paged_attention.h"

namespace punica_x {
namespace {

using namespace simd;

// The multiply-adds are written as FMAs (fmadd, std::fma): left to the compiler, `s += a * b`
// was contracted into an FMA in some instantiations and not in others (a bf16 block read as it
// is vs one widened to float first), so a row's scores and sums changed with how many (row,
// head) pairs shared its tile, which the batch-invariant mode must not see.
template <typename T>
inline float dot(const float* a, const T* b, int d) {
  int e = 0;
  float s = 0.f;
  if (d >= kLanes) {
    vf acc = load(a) * load(b);
    for (e = kLanes; e + kLanes <= d; e += kLanes) acc = fmadd(load(a + e), load(b + e), acc);
    s = hsum(acc);
  }
  for (; e < d; ++e) s = std::fma(a[e], f32(b[e]), s);
  return s;
}

// a[0:d] = a * c + sum_k w[k] * v[k * d : (k + 1) * d] over `keys` rows of v. The output row
// is held in registers a chunk of up to kChunk vectors at a time while every key's row is
// added (one load and store of `a` per chunk, not per key).
constexpr int kChunk = kVecRegs / 2;

template <typename T, int V>
inline void weighted_rows_chunk(float* a, float c, const float* w, const T* v, int keys, int d) {
  vf acc[V];
  const vf cv = splat(c);
  for (int j = 0; j < V; ++j) acc[j] = load(a + j * kLanes) * cv;
  for (int k = 0; k < keys; ++k) {
    const vf wk = splat(w[k]);
    for (int j = 0; j < V; ++j) acc[j] = fmadd(wk, load(v + int64_t(k) * d + j * kLanes), acc[j]);
  }
  for (int j = 0; j < V; ++j) store(a + j * kLanes, acc[j]);
}

template <typename T, int... V>
constexpr auto chunk_table(std::integer_sequence<int, V...>) {
  using Fn = void (*)(float*, float, const float*, const T*, int, int);
  return std::array<Fn, sizeof...(V)>{&weighted_rows_chunk<T, V + 1>...};
}

template <typename T>
inline void weighted_rows(float* a, float c, const float* w, const T* v, int keys, int d) {
  static const auto table = chunk_table<T>(std::make_integer_sequence<int, kChunk>{});
  int e = 0;
  while (e + kLanes <= d) {
    const int vecs = std::min(kChunk, (d - e) / kLanes);
    table[vecs - 1](a + e, c, w, v + e, keys, d);
    e += vecs * kLanes;
  }
  for (; e < d; ++e) {  // head sizes that are not a multiple of the vector width
    float x = a[e] * c;
    for (int k = 0; k < keys; ++k) x = std::fma(w[k], f32(v[int64_t(k) * d + e]), x);
    a[e] = x;
  }
}

constexpr int kRowBlock = 4;
constexpr int kMaxGroup = 16;
constexpr int kPairs = kRowBlock * kMaxGroup;

struct Item {
  int seq, head, row0, rows;
};

// A (row, head)'s output and lse from its online-softmax state (acc [d], max m, sum l).
template <typename T>
inline void finish_pair(T* o, float* lse, const float* acc, float m, float l, int d) {
  const float inv = 1.f / l;
  for (int e = 0; e < d; ++e) o[e] = narrow<T>(acc[e] * inv);
  *lse = m + std::log(l);
}

// Attention of `rows` consecutive query rows x G heads against the keys they may see, one
// KV block at a time: scores of the block for every (row, head), then a block-wise online
// softmax update (one rescale per block instead of one per key). Blocks wholly before the
// tile's first row's window are not read. state (or null): each pair's online-softmax state
// [T, H_q, D + 2] (acc, m, l) to start from and to leave, instead of out / lse.
template <typename T>
void attend_tile(T* out, float* lse, const T* q, int hq, const KvLayout& kv, const PagedSeqs& seqs,
                 const Item& it, const AttnParams& ap, float* state) {
  const float scale = ap.scale, cap = ap.softcap;
  const int d = kv.head_dim, p = kv.block_size;
  const int g = hq / kv.num_kv_heads;
  const int s = it.seq;
  const int first_pos = seqs.kv_len[s] - seqs.num_rows[s];
  const int32_t* table = seqs.block_table + seqs.table_start[s];
  const int n = it.rows * g;  // (row, head) pairs of this tile
  float m[kPairs], l[kPairs];
  // per-thread scratch, reused across items: q (pre-scaled), accumulators, block scores
  thread_local std::vector<float> scratch;
  scratch.assign(size_t(n) * (2 * d + p), 0.f);
  float* qt = scratch.data();
  float* acc = qt + n * d;
  float* scores = acc + n * d;
  for (int i = 0; i < n; ++i) {
    const int r = i / g, h = it.head * g + i % g;
    const T* src = q + (int64_t(seqs.row_start[s] + it.row0 + r) * hq + h) * d;
    for (int e = 0; e < d; ++e) qt[i * d + e] = f32(src[e]) * scale;
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.f;
    if (state) {  // go on from the keys before these blocks (DistKV's chained parts)
      const float* st = state + (int64_t(seqs.row_start[s] + it.row0 + r) * hq + h) * (d + 2);
      std::memcpy(acc + i * d, st, sizeof(float) * d);
      m[i] = st[d];
      l[i] = st[d + 1];
    }
  }
  const int num_keys = first_pos + it.row0 + it.rows;  // the tile's last row sees keys < this
  // the lowest key row r of the tile sees (position first_pos + row0 + r)
  auto lowest = [&](int r) { return ap.window > 0 ? std::max(0, first_pos + it.row0 + r - ap.window + 1) : 0; };
  const int64_t head_off = (int64_t(kv.layer) * 2 * kv.num_kv_heads + it.head) * p * d;
  const int64_t v_off = int64_t(kv.num_kv_heads) * p * d;
  for (int b = lowest(0) / p; b * p < num_keys; ++b) {
    const T* cache = static_cast<const T*>(kv.kv);
    const T* kb = cache + table[b] * kv.block_stride() + head_off;  // [P, D]
    const T* vb = kb + v_off;
    const int keys = std::min(p, num_keys - b * p);
    if ((b + 1) * p < num_keys) {  // blocks are scattered pages: prefetch the next one's K and V
      const T* next = cache + table[b + 1] * kv.block_stride() + head_off;
      for (int64_t off = 0; off < int64_t(p) * d; off += 64 / sizeof(T)) {
        __builtin_prefetch(next + off);
        __builtin_prefetch(next + v_off + off);
      }
    }
    // kb_, vb_: the block's K and V rows, as stored or widened to float32
    auto attend_block = [&](const auto* kb_, const auto* vb_) {
      for (int i = 0; i < n; ++i) {
        const int r = i / g;
        const int k0 = std::max(0, lowest(r) - b * p);  // keys [k0, visible) of the block
        const int visible = std::min(keys, first_pos + it.row0 + r + 1 - b * p);
        if (visible <= k0) continue;
        const float* qi = qt + i * d;
        float* sc = scores + i * p + k0;
        const int nk = visible - k0;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int k = 0; k < nk; ++k) {
          sc[k] = dot(qi, kb_ + (k0 + k) * d, d);
          if (cap > 0.f) sc[k] = cap * std::tanh(sc[k] / cap);  // logit soft-capping (Gemma 2)
          block_max = std::max(block_max, sc[k]);
        }
        const float new_m = std::max(m[i], block_max);
        const float c = std::exp(m[i] - new_m);
        float sum = 0.f;
        int k = 0;
        for (; k + kLanes <= nk; k += kLanes) {
          const vf e = simd::exp(load(sc + k) - splat(new_m));
          store(sc + k, e);
          sum += hsum(e);
        }
        for (; k < nk; ++k) {
          sc[k] = std::exp(sc[k] - new_m);
          sum += sc[k];
        }
        weighted_rows(acc + i * d, c, sc, vb_ + int64_t(k0) * d, nk, d);
        l[i] = std::fma(l[i], c, sum);
        m[i] = new_m;
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      attend_block(kb, vb);
    } else if (n == 1) {
      attend_block(kb, vb);  // one (row, head) pair reads each key once: widen on the fly
    } else {  // several pairs read every key: widen the block's K and V once
      thread_local std::vector<float> wide;
      wide.resize(size_t(2) * p * d);
      const int64_t len = int64_t(keys) * d;
      int64_t e = 0;
      for (; e + kLanes <= len; e += kLanes) {
        store(wide.data() + e, load(kb + e));
        store(wide.data() + p * d + e, load(vb + e));
      }
      for (; e < len; ++e) {
        wide[e] = f32(kb[e]);
        wide[p * d + e] = f32(vb[e]);
      }
      attend_block(static_cast<const float*>(wide.data()),
                   static_cast<const float*>(wide.data() + p * d));
    }
  }
  for (int i = 0; i < n; ++i) {
    const int r = i / g, h = it.head * g + i % g;
    const int64_t row = seqs.row_start[s] + it.row0 + r;
    if (state) {
      float* st = state + (row * hq + h) * (d + 2);
      std::memcpy(st, acc + i * d, sizeof(float) * d);
      st[d] = m[i];
      st[d + 1] = l[i];
    } else {
      finish_pair(out + (row * hq + h) * d, lse + row * hq + h, acc + i * d, m[i], l[i], d);
    }
  }
}

}  // namespace

template <typename T>
void paged_attention_cpu(T* out, float* lse, const T* q, int num_q_heads, const KvLayout& kv,
                         const PagedSeqs& seqs, const AttnParams& params, float* state) {
  std::vector<Item> items;
  for (int s = 0; s < seqs.num_seqs; ++s)
    for (int h = 0; h < kv.num_kv_heads; ++h)
      for (int r0 = 0; r0 < seqs.num_rows[s]; r0 += kRowBlock)
        items.push_back({s, h, r0, std::min(kRowBlock, seqs.num_rows[s] - r0)});
  parallel_items(int64_t(items.size()), [&](int64_t i) {
    attend_tile(out, lse, q, num_q_heads, kv, seqs, items[i], params, state);
  });
}

template <typename T>
void finish_state_cpu(T* out, float* lse, const float* state, int64_t pairs, int head_dim) {
  const int d = head_dim;
  for (int64_t i = 0; i < pairs; ++i) {
    const float* st = state + i * (d + 2);
    finish_pair(out + i * d, lse + i, st, st[d], st[d + 1], d);
  }
}

template <typename T>
void write_kv_cpu(T* kv, const KvLayout& layout, const T* k, const T* v, int rows,
                  const int64_t* blocks, const int64_t* offsets) {
  const int nkv = layout.num_kv_heads, p = layout.block_size, d = layout.head_dim;
  for (int t = 0; t < rows; ++t) {
    T* base = kv + blocks[t] * layout.block_stride() + int64_t(layout.layer) * 2 * nkv * p * d;
    for (int h = 0; h < nkv; ++h) {
      std::memcpy(base + (int64_t(h) * p + offsets[t]) * d, k + (int64_t(t) * nkv + h) * d, d * sizeof(T));
      std::memcpy(base + (int64_t(nkv + h) * p + offsets[t]) * d, v + (int64_t(t) * nkv + h) * d,
                  d * sizeof(T));
    }
  }
}

template <typename T>
void merge_rows_cpu(T* out, float* lse, const T* o, const float* s, int heads, int head_dim,
                    const int64_t* dst, const int64_t* src, int n) {
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < heads; ++h) {
      float& a = lse[dst[i] * heads + h];
      const float b = s[src[i] * heads + h];
      if (b == -std::numeric_limits<float>::infinity()) continue;  // the part saw no key
      const float m = std::max(a, b);
      const float ea = std::exp(a - m), eb = std::exp(b - m);
      const float w = eb / (ea + eb);
      a = m + std::log(ea + eb);
      T* y = out + (dst[i] * heads + h) * int64_t(head_dim);
      const T* x = o + (src[i] * heads + h) * int64_t(head_dim);
      for (int d = 0; d < head_dim; ++d) {
        const float yd = simd::f32(y[d]);
        y[d] = simd::narrow<T>(yd + w * (simd::f32(x[d]) - yd));
      }
    }
  }
}

template void merge_rows_cpu<float>(float*, float*, const float*, const float*, int, int,
                                     const int64_t*, const int64_t*, int);
template void merge_rows_cpu<simd::bf16>(simd::bf16*, float*, const simd::bf16*, const float*, int,
                                          int, const int64_t*, const int64_t*, int);
template void paged_attention_cpu<float>(float*, float*, const float*, int, const KvLayout&,
                                          const PagedSeqs&, const AttnParams&, float*);
template void paged_attention_cpu<simd::bf16>(simd::bf16*, float*, const simd::bf16*, int,
                                               const KvLayout&, const PagedSeqs&, const AttnParams&, float*);
template void finish_state_cpu<float>(float*, float*, const float*, int64_t, int);
template void finish_state_cpu<simd::bf16>(simd::bf16*, float*, const float*, int64_t, int);
template void write_kv_cpu<float>(float*, const KvLayout&, const float*, const float*, int,
                                   const int64_t*, const int64_t*);
template void write_kv_cpu<simd::bf16>(simd::bf16*, const KvLayout&, const simd::bf16*,
                                        const simd::bf16*, int, const int64_t*, const int64_t*);

}  // namespace punica_x
