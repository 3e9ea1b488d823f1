// Paged attention on the CPU over the punica-x KV layout kv[num_blocks, L, 2, N_kv, P, D].
//
// Sequence s owns query rows [row_start[s], row_start[s] + num_rows[s]); they are the last
// num_rows[s] of its kv_len[s] tokens and attend causally: row i (position
// kv_len - num_rows + i) sees keys 0..position, or with a sliding window W > 0 only the W
// keys position - W + 1..position (HF's sliding_window: Mistral, Gemma's local layers). Its blocks are
// block_table[table_start[s] .. table_start[s + 1]). Query head h reads KV head h / G,
// G = H_q / N_kv. Outputs: out[T, H_q, D] and lse[T, H_q] (natural-log log-sum-exp of the
// scaled scores), so partial results over disjoint key sets merge exactly.
#pragma once

#include <cstdint>

namespace punica_x {

struct PagedSeqs {
  const int32_t* row_start;    // [S]
  const int32_t* num_rows;     // [S]
  const int32_t* kv_len;       // [S]
  const int32_t* table_start;  // [S + 1]
  const int32_t* block_table;  // [table_start[S]]
  int num_seqs;
};

struct KvLayout {
  const void* kv;  // [num_blocks, L, 2, N_kv, P, D] of T (float or simd::bf16)
  int num_layers, num_kv_heads, block_size, head_dim;
  int layer;
  int64_t block_stride() const { return int64_t(num_layers) * 2 * num_kv_heads * block_size * head_dim; }
};

// scale: multiplies q.k; window: W above (0: none); softcap: scores become
// softcap * tanh(score / softcap) after scaling (Gemma 2's attention soft-capping; 0: none).
struct AttnParams {
  float scale;
  int window;
  float softcap;
};

// T: float or simd::bf16 for q, out and the cache (scores, softmax and sums in float32, lse
// float32 over the capped scores); instantiated for both.
// state (or null): float32 [T, H_q, D + 2], each (row, head)'s online-softmax state (the
// weighted sum of values [D], the running max, the running sum; an empty one: 0, -inf, 0).
// The kernel then starts from it and leaves it there instead of writing out / lse: a
// sequence's keys split into parts held apart (DistKV) and attended part after part, in key
// order, give the bits one call over all of them gives (finish_state_cpu writes them).
template <typename T>
void paged_attention_cpu(T* out, float* lse, const T* q, int num_q_heads, const KvLayout& kv,
                         const PagedSeqs& seqs, const AttnParams& params, float* state = nullptr);

// out [pairs, D], lse [pairs] of the states [pairs, D + 2], as the kernel finishes its own.
template <typename T>
void finish_state_cpu(T* out, float* lse, const float* state, int64_t pairs, int head_dim);

// kv[block[t], layer, 0/1, :, offset[t], :] = k[t] / v[t] for every row t (k, v: [T, N_kv, D]).
template <typename T>
void write_kv_cpu(T* kv, const KvLayout& layout, const T* k, const T* v, int rows,
                  const int64_t* blocks, const int64_t* offsets);

// ScaleReduce of partial attention results, in place: for i < n, row dst[i] of (out [., H, D],
// lse [., H]) absorbs row src[i] of (o, s), the same rows' attention over other keys:
// w = sigmoid(s - lse), out += w * (o - out), lse = logaddexp(lse, s) (in float32; a row with
// lse = -inf, no key yet, becomes the part). One call per creditor per layer instead of six
// tensor ops per merged run of rows (DistAttention's fixed cost per remote part).
template <typename T>
void merge_rows_cpu(T* out, float* lse, const T* o, const float* s, int heads, int head_dim,
                    const int64_t* dst, const int64_t* src, int n);

}  // namespace punica_x
