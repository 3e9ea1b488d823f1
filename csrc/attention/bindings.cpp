// Torch bindings for CPU paged attention; every input is checked, errors name the tensor.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "../common/dispatch.h"
#include "../common/simd.h"
#include "../layers/fused.h"
#include "paged_attention.h"

namespace {

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "paged_attention: ", __VA_ARGS__)

using punica_x::simd::bf16;

void check_cpu(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  CHECK_ARG(t.device().is_cpu(), name, " must be on the CPU");
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
}

// The cache is float32 or bfloat16; q, k, v and out must be of the cache's dtype.
punica_x::KvLayout layout(const torch::Tensor& kv, int64_t layer) {
  CHECK_ARG(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16,
            "kv must be float32 or bfloat16, got ", kv.scalar_type());
  check_cpu(kv, "kv", kv.scalar_type());
  CHECK_ARG(kv.dim() == 6 && kv.size(2) == 2, "kv must be [blocks, L, 2, N_kv, P, D], got ", kv.sizes());
  CHECK_ARG(layer >= 0 && layer < kv.size(1), "layer ", layer, " out of range [0, ", kv.size(1), ")");
  return punica_x::KvLayout{kv.data_ptr(), static_cast<int>(kv.size(1)), static_cast<int>(kv.size(3)),
                            static_cast<int>(kv.size(4)), static_cast<int>(kv.size(5)), static_cast<int>(layer)};
}

// The query's shape against the cache and the attention parameters.
void check_heads(int64_t hq, const punica_x::KvLayout& kvl, int64_t window, double softcap) {
  CHECK_ARG(hq % kvl.num_kv_heads == 0 && hq / kvl.num_kv_heads <= 16, "H_q=", hq,
            " must be a multiple of N_kv=", kvl.num_kv_heads, " (at most 16x)");
  CHECK_ARG(kvl.head_dim <= 256, "head_dim ", kvl.head_dim, " > 256");
  CHECK_ARG(window >= 0 && window <= INT32_MAX, "window must be >= 0 (0: none), got ", window);
  CHECK_ARG(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none), got ", softcap);
}

// seqs = [row_start, num_rows, kv_len] as int32 [3, S] over `rows` query rows; table_start
// int32 [S + 1]; block_table int32: checked, as the kernel reads them.
punica_x::PagedSeqs check_seqs(const torch::Tensor& seqs, const torch::Tensor& table_start,
                               const torch::Tensor& block_table, int64_t rows_total, const torch::Tensor& kv,
                               const punica_x::KvLayout& kvl) {
  check_cpu(seqs, "seqs", at::kInt);
  check_cpu(table_start, "table_start", at::kInt);
  check_cpu(block_table, "block_table", at::kInt);
  CHECK_ARG(seqs.dim() == 2 && seqs.size(0) == 3, "seqs must be [3, S], got ", seqs.sizes());
  const int64_t s = seqs.size(1);
  CHECK_ARG(table_start.dim() == 1 && table_start.size(0) == s + 1, "table_start must be [S + 1]");
  const int32_t* row = seqs.data_ptr<int32_t>();
  const int32_t* rows = row + s;
  const int32_t* len = rows + s;
  const int32_t* ts = table_start.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  CHECK_ARG(ts[0] == 0 && ts[s] == block_table.numel(), "table_start must span block_table");
  for (int64_t i = 0; i < s; ++i) {
    CHECK_ARG(rows[i] >= 1 && len[i] >= rows[i], "sequence ", i, ": num_rows=", rows[i], " kv_len=", len[i]);
    CHECK_ARG(row[i] >= 0 && row[i] + rows[i] <= rows_total, "sequence ", i, " rows out of range");
    CHECK_ARG(int64_t(ts[i + 1] - ts[i]) * kvl.block_size >= len[i], "sequence ", i, " has too few blocks");
    for (int32_t b = ts[i]; b < ts[i + 1]; ++b)
      CHECK_ARG(bt[b] >= 0 && bt[b] < kv.size(0), "block id ", bt[b], " out of range");
  }
  return punica_x::PagedSeqs{row, rows, len, ts, bt, static_cast<int>(s)};
}

// One slot (block, offset) per row, each inside the cache.
void check_slots(const torch::Tensor& blocks, const torch::Tensor& offsets, int64_t rows, const torch::Tensor& kv,
                 const punica_x::KvLayout& kvl) {
  check_cpu(blocks, "blocks", at::kLong);
  check_cpu(offsets, "offsets", at::kLong);
  CHECK_ARG(blocks.numel() == rows && offsets.numel() == rows, "one block/offset per row");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    CHECK_ARG(b[t] >= 0 && b[t] < kv.size(0) && o[t] >= 0 && o[t] < kvl.block_size, "row ", t,
              ": slot (", b[t], ", ", o[t], ") out of range");
}

using punica_x::dispatch;
using punica_x::ptr;

// out, lse = attention of q's rows (see paged_attention.h); seqs = [row_start, num_rows,
// kv_len] as int32 [3, S]; table_start int32 [S + 1]; block_table int32.
void paged_attention(torch::Tensor out, torch::Tensor lse, torch::Tensor q, torch::Tensor kv, int64_t layer,
                     torch::Tensor seqs, torch::Tensor table_start, torch::Tensor block_table, double scale,
                     int64_t window, double softcap) {
  const punica_x::KvLayout kvl = layout(kv, layer);
  check_cpu(q, "q", kv.scalar_type());
  check_cpu(out, "out", kv.scalar_type());
  check_cpu(lse, "lse", at::kFloat);
  CHECK_ARG(q.dim() == 3 && q.size(2) == kvl.head_dim, "q must be [T, H_q, ", kvl.head_dim, "], got ", q.sizes());
  check_heads(q.size(1), kvl, window, softcap);
  CHECK_ARG(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  CHECK_ARG(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "lse must be [T, H_q], got ",
            lse.sizes());
  const punica_x::PagedSeqs ps = check_seqs(seqs, table_start, block_table, q.size(0), kv, kvl);
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  const int hq = static_cast<int>(q.size(1));
  const punica_x::AttnParams ap{static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
  dispatch(kv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::paged_attention_cpu(ptr<T>(out), lse.data_ptr<float>(), ptr<const T>(q), hq, kvl, ps, ap);
  });
}

// A layer's attention from its fused q|k|v projection output in one call: RoPE on q's and k's
// heads in place (csrc/layers: rope_cpu, the fused layers' arithmetic), k and v stored into
// their slots, then paged_attention of q. qkv: [T, (H_q + 2 N_kv) D] of the cache's dtype,
// contiguous; positions int64 [T]; cos/sin [max_pos, D]; blocks/offsets as write_kv's; seqs,
// table_start, block_table as paged_attention's. Returns (out [T, H_q * D], lse [T, H_q]).
std::tuple<torch::Tensor, torch::Tensor> rope_write_attend(
    torch::Tensor qkv, int64_t heads, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor kv, int64_t layer, torch::Tensor blocks, torch::Tensor offsets, torch::Tensor seqs,
    torch::Tensor table_start, torch::Tensor block_table, double scale, int64_t window, double softcap) {
  const punica_x::KvLayout kvl = layout(kv, layer);
  const auto dtype = kv.scalar_type();
  const int64_t d = kvl.head_dim, nkv = kvl.num_kv_heads;
  check_cpu(qkv, "qkv", dtype);
  CHECK_ARG(heads >= 1 && heads <= 4096, "heads must be in [1, 4096], got ", heads);
  CHECK_ARG(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * nkv) * d, "qkv must be [T, ", (heads + 2 * nkv) * d,
            "], got ", qkv.sizes());
  check_heads(heads, kvl, window, softcap);
  CHECK_ARG(d % 2 == 0, "head_dim must be even for RoPE");
  check_cpu(cos, "cos", dtype);
  check_cpu(sin, "sin", dtype);
  CHECK_ARG(cos.dim() == 2 && cos.size(1) == d && sin.sizes() == cos.sizes(), "cos/sin must be [max_pos, ", d,
            "]");
  const int64_t rows = qkv.size(0);
  check_cpu(positions, "positions", at::kLong);
  CHECK_ARG(positions.dim() == 1 && positions.size(0) == rows, "positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    CHECK_ARG(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the table");
  check_slots(blocks, offsets, rows, kv, kvl);
  const punica_x::PagedSeqs ps = check_seqs(seqs, table_start, block_table, rows, kv, kvl);
  auto out = torch::empty({rows, heads * d}, qkv.options());
  auto lse = torch::empty({rows, heads}, qkv.options().dtype(at::kFloat));
  auto q = torch::empty({rows, heads * d}, qkv.options());  // q's rows, contiguous for the kernel
  pybind11::gil_scoped_release no_gil;
  const int64_t width = qkv.size(1);
  const punica_x::AttnParams ap{static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* x = ptr<T>(qkv);
    punica_x::rope_cpu<T>(x, width, rows, int(heads), int(d), pos, ptr<T>(cos), ptr<T>(sin));
    punica_x::rope_cpu<T>(x + heads * d, width, rows, int(nkv), int(d), pos, ptr<T>(cos), ptr<T>(sin));
    T* qc = ptr<T>(q);
    for (int64_t t = 0; t < rows; ++t) {
      const T* row = x + t * width;
      std::memcpy(qc + t * heads * d, row, heads * d * sizeof(T));
      punica_x::write_kv_cpu(ptr<T>(kv), kvl, row + heads * d, row + (heads + nkv) * d, 1,
                             blocks.data_ptr<int64_t>() + t, offsets.data_ptr<int64_t>() + t);
    }
    punica_x::paged_attention_cpu(ptr<T>(out), lse.data_ptr<float>(), static_cast<const T*>(qc), int(heads), kvl,
                                  ps, ap);
  });
  return {out, lse};
}

void write_kv(torch::Tensor kv, int64_t layer, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
              torch::Tensor offsets) {
  const punica_x::KvLayout kvl = layout(kv, layer);
  check_cpu(k, "k", kv.scalar_type());
  check_cpu(v, "v", kv.scalar_type());
  CHECK_ARG(k.dim() == 3 && k.size(1) == kvl.num_kv_heads && k.size(2) == kvl.head_dim,
            "k must be [T, N_kv, D], got ", k.sizes());
  CHECK_ARG(v.sizes() == k.sizes(), "v must match k");
  check_slots(blocks, offsets, k.size(0), kv, kvl);
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  const int rows = static_cast<int>(k.size(0));
  dispatch(kv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::write_kv_cpu(ptr<T>(kv), kvl, ptr<const T>(k), ptr<const T>(v), rows, blocks.data_ptr<int64_t>(),
                           offsets.data_ptr<int64_t>());
  });
}

// state [T, H_q, D + 2] float32 goes on over q's keys in this call (see paged_attention.h):
// paged_attention that starts from each (row, head)'s state and leaves it there.
void paged_attention_state(torch::Tensor state, torch::Tensor q, torch::Tensor kv, int64_t layer,
                           torch::Tensor seqs, torch::Tensor table_start, torch::Tensor block_table, double scale,
                           int64_t window, double softcap) {
  const punica_x::KvLayout kvl = layout(kv, layer);
  check_cpu(q, "q", kv.scalar_type());
  check_cpu(state, "state", at::kFloat);
  CHECK_ARG(q.dim() == 3 && q.size(2) == kvl.head_dim, "q must be [T, H_q, ", kvl.head_dim, "], got ", q.sizes());
  check_heads(q.size(1), kvl, window, softcap);
  CHECK_ARG(state.dim() == 3 && state.size(0) == q.size(0) && state.size(1) == q.size(1) &&
                state.size(2) == kvl.head_dim + 2,
            "state must be [T, H_q, D + 2] for q ", q.sizes(), ", got ", state.sizes());
  const punica_x::PagedSeqs ps = check_seqs(seqs, table_start, block_table, q.size(0), kv, kvl);
  pybind11::gil_scoped_release no_gil;
  const int hq = static_cast<int>(q.size(1));
  const punica_x::AttnParams ap{static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
  dispatch(kv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::paged_attention_cpu(static_cast<T*>(nullptr), nullptr, ptr<const T>(q), hq, kvl, ps, ap,
                                  state.data_ptr<float>());
  });
}

// out [T, H, D], lse [T, H] of the states [T, H, D + 2], bit for bit as the kernel's own.
void finish_state(torch::Tensor out, torch::Tensor lse, torch::Tensor state) {
  const auto dtype = out.scalar_type();
  CHECK_ARG(dtype == at::kFloat || dtype == at::kBFloat16, "out must be float32 or bfloat16, got ", dtype);
  check_cpu(out, "out", dtype);
  check_cpu(lse, "lse", at::kFloat);
  check_cpu(state, "state", at::kFloat);
  CHECK_ARG(out.dim() == 3 && state.dim() == 3 && state.size(0) == out.size(0) && state.size(1) == out.size(1) &&
                state.size(2) == out.size(2) + 2,
            "state must be [T, H, D + 2] for out ", out.sizes(), ", got ", state.sizes());
  CHECK_ARG(lse.dim() == 2 && lse.size(0) == out.size(0) && lse.size(1) == out.size(1), "lse must be [T, H]");
  const int64_t pairs = out.size(0) * out.size(1);
  const int dim = static_cast<int>(out.size(2));
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kFloat)
    punica_x::finish_state_cpu(out.data_ptr<float>(), lse.data_ptr<float>(), state.data_ptr<float>(), pairs, dim);
  else
    punica_x::finish_state_cpu(static_cast<bf16*>(out.data_ptr()), lse.data_ptr<float>(), state.data_ptr<float>(),
                               pairs, dim);
}

// Row dst[i] of (out, lse) absorbs row src[i] of (o, s): see merge_rows_cpu.
void merge_rows(torch::Tensor out, torch::Tensor lse, torch::Tensor o, torch::Tensor s, torch::Tensor dst,
                torch::Tensor src) {
  const auto dtype = out.scalar_type();
  CHECK_ARG(dtype == at::kFloat || dtype == at::kBFloat16, "out must be float32 or bfloat16, got ", dtype);
  check_cpu(out, "out", dtype);
  check_cpu(o, "o", dtype);
  check_cpu(lse, "lse", at::kFloat);
  check_cpu(s, "s", at::kFloat);
  check_cpu(dst, "dst", at::kLong);
  check_cpu(src, "src", at::kLong);
  CHECK_ARG(out.dim() == 3 && o.dim() == 3 && out.size(1) == o.size(1) && out.size(2) == o.size(2),
            "out and o must be [., H, D] alike, got ", out.sizes(), " and ", o.sizes());
  CHECK_ARG(lse.dim() == 2 && lse.size(0) == out.size(0) && lse.size(1) == out.size(1), "lse must be [",
            out.size(0), ", ", out.size(1), "], got ", lse.sizes());
  CHECK_ARG(s.dim() == 2 && s.size(0) == o.size(0) && s.size(1) == o.size(1), "s must be [", o.size(0), ", ",
            o.size(1), "], got ", s.sizes());
  CHECK_ARG(dst.dim() == 1 && src.sizes() == dst.sizes(), "dst and src must be vectors of one length");
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* r = src.data_ptr<int64_t>();
  for (int64_t i = 0; i < dst.numel(); ++i)
    CHECK_ARG(d[i] >= 0 && d[i] < out.size(0) && r[i] >= 0 && r[i] < o.size(0), "pair ", i, " (", d[i], ", ",
              r[i], ") out of range");
  const int heads = static_cast<int>(out.size(1)), dim = static_cast<int>(out.size(2));
  const int n = static_cast<int>(dst.numel());
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kFloat)
    punica_x::merge_rows_cpu(out.data_ptr<float>(), lse.data_ptr<float>(), o.data_ptr<float>(),
                             s.data_ptr<float>(), heads, dim, d, r, n);
  else
    punica_x::merge_rows_cpu(static_cast<bf16*>(out.data_ptr()), lse.data_ptr<float>(),
                             static_cast<const bf16*>(o.data_ptr()), s.data_ptr<float>(), heads, dim, d, r, n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("paged_attention", &paged_attention, "paged attention with log-sum-exp (CPU)");
  m.def("write_kv", &write_kv, "store K/V rows into their cache slots (CPU)");
  m.def("rope_write_attend", &rope_write_attend, "RoPE, K/V store and paged attention of a fused qkv (CPU)");
  m.def("merge_rows", &merge_rows, "merge partial attention (out, lse) rows in place (CPU)");
  m.def("paged_attention_state", &paged_attention_state,
        "paged attention going on from each row's online-softmax state (CPU)");
  m.def("finish_state", &finish_state, "out and lse of online-softmax states (CPU)");
}
