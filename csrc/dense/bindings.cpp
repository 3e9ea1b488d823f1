// Torch bindings for the packed dense GEMM; every input is checked, errors name the tensor.
#include <torch/extension.h>

#include <vector>

#include "../common/simd.h"
#include "dense.h"

namespace {

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "dense: ", __VA_ARGS__)

using punica_x::simd::bf16;

// Every operand of one call has one dtype: float32 or bfloat16.
void check_cpu(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  CHECK_ARG(t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16), name,
            " must be a float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, " like the other operands, got ",
            t.scalar_type());
}

int64_t panels(int64_t n) { return (n + punica_x::kDensePanel - 1) / punica_x::kDensePanel; }

// [rows, columns] of one packed panel for K and a dtype (dense.h: bf16 on the avx512_bf16
// build packs K pairs side by side).
std::pair<int64_t, int64_t> panel_shape(int64_t k, at::ScalarType dtype) {
  if (dtype == at::kFloat) return {punica_x::dense_packed_rows<float>(k), punica_x::kDensePanel};
  return {punica_x::dense_packed_rows<bf16>(k), punica_x::kDensePanel * punica_x::kDenseKPack<bf16>};
}

// weight: [N, K] (nn.Linear layout) -> packed [panels, rows, columns] (panel_shape).
torch::Tensor pack(torch::Tensor weight) {
  check_cpu(weight, "weight", weight.scalar_type());
  CHECK_ARG(weight.dim() == 2 && weight.stride(1) == 1, "weight must be 2-D with contiguous rows, got ",
            weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto [rows, cols] = panel_shape(k, weight.scalar_type());
  auto packed = torch::empty({panels(n), rows, cols}, weight.options());
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  if (weight.scalar_type() == at::kFloat)
    punica_x::dense_pack_cpu(packed.data_ptr<float>(), weight.data_ptr<float>(), weight.stride(0), int(k),
                             int(n), true);
  else
    punica_x::dense_pack_cpu(static_cast<bf16*>(packed.data_ptr()), static_cast<const bf16*>(weight.data_ptr()),
                             weight.stride(0), int(k), int(n), true);
  return packed;
}

// y[M, N] = x[M, K] @ W (+ bias); y, x with contiguous rows (y may be a column slice).
// The regions of a prefetch hint: [R, 2] int64 (address, bytes) on the CPU. The addresses are
// not checked: a prefetch never faults, and SgmvWeights owns the tensors they point to.
punica_x::PrefetchSpans check_spans(const torch::Tensor& p) {
  CHECK_ARG(p.device().is_cpu() && p.scalar_type() == at::kLong && p.dim() == 2 && p.size(1) == 2 &&
                p.is_contiguous(),
            "prefetch must be a contiguous [regions, 2] int64 CPU tensor, got ", p.scalar_type(), " ", p.sizes(),
            " on ", p.device());
  const int64_t* s = p.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.size(0); ++i)
    CHECK_ARG(s[2 * i + 1] >= 0 && s[2 * i + 1] <= (int64_t(1) << 40), "prefetch region ", i,
              " has ", s[2 * i + 1], " bytes (0 .. 2^40)");
  CHECK_ARG(p.size(0) <= (int64_t(1) << 30), "prefetch has ", p.size(0), " regions");
  return {s, int(p.size(0))};
}

// The line addresses the GEMM's `parts` work items would prefetch, in order, `step` a call
// (tests check that they cover every line of the regions once).
torch::Tensor prefetch_walk(torch::Tensor prefetch, int64_t parts, int64_t step) {
  CHECK_ARG(parts >= 1 && step >= 1, "parts and step must be >= 1");
  const auto spans = check_spans(prefetch);
  const int64_t lines = spans.lines();
  std::vector<int64_t> out;
  for (int64_t p = 0; p < parts; ++p) {
    auto cursor = punica_x::PrefetchCursor::part(spans, lines, p, parts);
    while (cursor.left())
      cursor.walk(int(step), [&](const char* line) { out.push_back(reinterpret_cast<int64_t>(line)); });
  }
  return torch::tensor(out, torch::kLong);
}

// prefetch: optional regions to pull into L2 during the GEMM (check_spans).
void gemm(torch::Tensor y, torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
          c10::optional<torch::Tensor> prefetch) {
  const auto dtype = x.scalar_type();
  check_cpu(x, "x", dtype);
  check_cpu(y, "y", dtype);
  check_cpu(packed, "packed", dtype);
  CHECK_ARG(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows, got ", x.sizes());
  CHECK_ARG(y.dim() == 2 && y.stride(1) == 1, "y must be 2-D with contiguous rows, got ", y.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  const auto [rows, cols] = panel_shape(k, dtype);
  CHECK_ARG(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == rows && packed.size(2) == cols,
            "packed must be contiguous [panels, ", rows, ", ", cols, "] for x with K=", k, ", got ",
            packed.sizes());
  CHECK_ARG(packed.size(0) == panels(n), "packed has ", packed.size(0), " panels, N=", n, " needs ", panels(n));
  CHECK_ARG(y.size(0) == m && y.size(1) == n, "y must be [", m, ", ", n, "], got ", y.sizes());
  const void* b = nullptr;
  if (bias.has_value()) {
    check_cpu(*bias, "bias", dtype);
    CHECK_ARG(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be [", n, "]");
    b = bias->data_ptr();
  }
  const punica_x::PrefetchSpans spans = prefetch.has_value() ? check_spans(*prefetch) : punica_x::PrefetchSpans{};
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  if (dtype == at::kFloat)
    punica_x::dense_gemm_cpu(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
                             packed.data_ptr<float>(), static_cast<const float*>(b), int(m), int(k), int(n), spans);
  else
    punica_x::dense_gemm_cpu(static_cast<bf16*>(y.data_ptr()), y.stride(0), static_cast<const bf16*>(x.data_ptr()),
                             x.stride(0), static_cast<const bf16*>(packed.data_ptr()),
                             static_cast<const bf16*>(b), int(m), int(k), int(n), spans);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("pack", &pack, "pack an [N, K] weight into panels");
  m.def("gemm", &gemm, "y = x @ W (+ bias) with a packed W", py::arg("y"), py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias"), py::arg("prefetch") = py::none());
  m.def("panel", [] { return punica_x::kDensePanel; });
  m.def("prefetch_walk", &prefetch_walk, "line addresses of a prefetch hint split in parts (tests)");
}
