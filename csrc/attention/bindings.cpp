// Torch bindings for CPU paged attention; every input is checked, errors name the tensor.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "../common/simd.h"
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
  CHECK_ARG(q.size(1) % kvl.num_kv_heads == 0 && q.size(1) / kvl.num_kv_heads <= 16,
            "H_q=", q.size(1), " must be a multiple of N_kv=", kvl.num_kv_heads, " (at most 16x)");
  CHECK_ARG(kvl.head_dim <= 256, "head_dim ", kvl.head_dim, " > 256");
  CHECK_ARG(window >= 0 && window <= INT32_MAX, "window must be >= 0 (0: none), got ", window);
  CHECK_ARG(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none), got ", softcap);
  CHECK_ARG(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  CHECK_ARG(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "lse must be [T, H_q], got ",
            lse.sizes());
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
    CHECK_ARG(row[i] >= 0 && row[i] + rows[i] <= q.size(0), "sequence ", i, " rows out of range");
    CHECK_ARG(int64_t(ts[i + 1] - ts[i]) * kvl.block_size >= len[i], "sequence ", i, " has too few blocks");
    for (int32_t b = ts[i]; b < ts[i + 1]; ++b)
      CHECK_ARG(bt[b] >= 0 && bt[b] < kv.size(0), "block id ", bt[b], " out of range");
  }
  const punica_x::PagedSeqs ps{row, rows, len, ts, bt, static_cast<int>(s)};
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  const int hq = static_cast<int>(q.size(1));
  const punica_x::AttnParams ap{static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
  if (kv.scalar_type() == at::kFloat)
    punica_x::paged_attention_cpu(out.data_ptr<float>(), lse.data_ptr<float>(), q.data_ptr<float>(),
                                  hq, kvl, ps, ap);
  else
    punica_x::paged_attention_cpu(static_cast<bf16*>(out.data_ptr()), lse.data_ptr<float>(),
                                  static_cast<const bf16*>(q.data_ptr()), hq, kvl, ps, ap);
}

void write_kv(torch::Tensor kv, int64_t layer, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
              torch::Tensor offsets) {
  const punica_x::KvLayout kvl = layout(kv, layer);
  check_cpu(k, "k", kv.scalar_type());
  check_cpu(v, "v", kv.scalar_type());
  check_cpu(blocks, "blocks", at::kLong);
  check_cpu(offsets, "offsets", at::kLong);
  CHECK_ARG(k.dim() == 3 && k.size(1) == kvl.num_kv_heads && k.size(2) == kvl.head_dim,
            "k must be [T, N_kv, D], got ", k.sizes());
  CHECK_ARG(v.sizes() == k.sizes(), "v must match k");
  CHECK_ARG(blocks.numel() == k.size(0) && offsets.numel() == k.size(0), "one block/offset per row");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    CHECK_ARG(b[t] >= 0 && b[t] < kv.size(0) && o[t] >= 0 && o[t] < kvl.block_size, "row ", t,
              ": slot (", b[t], ", ", o[t], ") out of range");
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  const int rows = static_cast<int>(k.size(0));
  if (kv.scalar_type() == at::kFloat)
    punica_x::write_kv_cpu(kv.data_ptr<float>(), kvl, k.data_ptr<float>(), v.data_ptr<float>(), rows,
                           b, o);
  else
    punica_x::write_kv_cpu(static_cast<bf16*>(kv.data_ptr()), kvl, static_cast<const bf16*>(k.data_ptr()),
                           static_cast<const bf16*>(v.data_ptr()), rows, b, o);
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
  m.def("merge_rows", &merge_rows, "merge partial attention (out, lse) rows in place (CPU)");
}
