// Torch bindings for the quantized dense kernels (quant.h); every input is checked, errors name
// the tensor.
#include <torch/extension.h>

#include "../common/simd.h"
#include "quant.h"

namespace {

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "quant: ", __VA_ARGS__)

using punica_x::simd::bf16;
namespace q = punica_x::quant;

void check_float(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  CHECK_ARG(t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16), name,
            " must be a float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, " like x, got ", t.scalar_type());
}

// w: [N, K / 32 * block_bytes(format)] uint8, contiguous.
void check_blocks(const torch::Tensor& w, int64_t format, int64_t k) {
  CHECK_ARG(q::block_bytes(int(format)) > 0, "unknown block format ", format, " (2: Q4_0, 3: Q4_1, 8: Q8_0)");
  CHECK_ARG(k > 0 && k % q::kBlock == 0 && k <= (int64_t(1) << 24), "K must be a positive multiple of ", q::kBlock,
            ", got ", k);
  CHECK_ARG(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
            "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  const int64_t want = k / q::kBlock * q::block_bytes(int(format));
  CHECK_ARG(w.size(1) == want, "w rows must hold ", want, " bytes for K=", k, " in format ", format, ", got ",
            w.size(1));
  CHECK_ARG(w.size(0) > 0 && w.size(0) < (int64_t(1) << 31), "w must have 1 .. 2^31 rows, got ", w.size(0));
}

// Checks y [M, N], x [M, K] (contiguous rows; y may be a column slice) and bias ([N] or none,
// x's dtype); returns the bias pointer.
const void* check_product(const torch::Tensor& y, const torch::Tensor& x, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  check_float(x, "x", dtype);
  check_float(y, "y", dtype);
  CHECK_ARG(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows, got ", x.sizes());
  CHECK_ARG(y.dim() == 2 && y.stride(1) == 1, "y must be 2-D with contiguous rows, got ", y.sizes());
  CHECK_ARG(x.size(0) < (int64_t(1) << 31), "x has too many rows");
  CHECK_ARG(y.size(0) == x.size(0) && y.size(1) == n, "y must be [", x.size(0), ", ", n, "], got ", y.sizes());
  if (!bias.has_value()) return nullptr;
  check_float(*bias, "bias", dtype);
  CHECK_ARG(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be [", n, "]");
  return bias->data_ptr();
}

// y[M, N] = x[M, K] @ W^T (+ bias), x as it is (qgemm_cpu).
void qgemm(torch::Tensor y, torch::Tensor x, torch::Tensor w, int64_t format, c10::optional<torch::Tensor> bias,
           bool fixed_order) {
  CHECK_ARG(x.dim() == 2, "x must be 2-D, got ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  check_blocks(w, format, k);
  const int64_t n = w.size(0);
  const void* b = check_product(y, x, n, bias);
  if (m == 0) return;
  pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
  const auto run = [&](auto* yp, const auto* xp, const auto* bp) {
    q::qgemm_cpu(yp, y.stride(0), xp, x.stride(0), w.data_ptr<uint8_t>(), w.size(1), int(format), bp, int(m), int(k),
                 int(n), fixed_order);
  };
  if (x.scalar_type() == at::kFloat)
    run(y.data_ptr<float>(), x.data_ptr<float>(), static_cast<const float*>(b));
  else
    run(static_cast<bf16*>(y.data_ptr()), static_cast<const bf16*>(x.data_ptr()), static_cast<const bf16*>(b));
}

// w grouped (q::group_rows_cpu) for n rows of K: [ceil(n / kGroup), K / 32 * kGroup * block_bytes].
void check_grouped(const torch::Tensor& w, int64_t format, int64_t k, int64_t n) {
  CHECK_ARG(q::block_bytes(int(format)) > 0, "unknown block format ", format, " (2: Q4_0, 3: Q4_1, 8: Q8_0)");
  CHECK_ARG(k > 0 && k % q::kBlock == 0 && k <= (int64_t(1) << 24), "K must be a positive multiple of ", q::kBlock,
            ", got ", k);
  CHECK_ARG(n > 0 && n < (int64_t(1) << 31), "N must be 1 .. 2^31, got ", n);
  CHECK_ARG(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
            "w must be a contiguous 2-D uint8 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  const int64_t groups = (n + q::kGroup - 1) / q::kGroup;
  const int64_t want = k / q::kBlock * q::kGroup * q::block_bytes(int(format));
  CHECK_ARG(w.size(0) == groups && w.size(1) == want, "grouped w for ", n, " rows of K=", k, " in format ", format,
            " must be [", groups, ", ", want, "], got ", w.sizes());
}

// y[M, N] = x[M, K] @ W^T (+ bias) for W grouped (group_rows), N = y's columns, x rounded to
// integers of x_bits (8 or 16) per block of 32 (qgemm_grouped_cpu).
void qgemm_grouped(torch::Tensor y, torch::Tensor x, torch::Tensor w, int64_t format,
                   c10::optional<torch::Tensor> bias, int64_t x_bits) {
  CHECK_ARG(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16, got ", x_bits);
  CHECK_ARG(x.dim() == 2 && y.dim() == 2, "x and y must be 2-D, got ", x.sizes(), " and ", y.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  check_grouped(w, format, k, n);
  const void* b = check_product(y, x, n, bias);
  if (m == 0) return;
  pybind11::gil_scoped_release no_gil;
  const auto run = [&](auto* yp, const auto* xp, const auto* bp) {
    q::qgemm_grouped_cpu(yp, y.stride(0), xp, x.stride(0), w.data_ptr<uint8_t>(), int(format), bp, int(m), int(k),
                         int(n), int(x_bits));
  };
  if (x.scalar_type() == at::kFloat)
    run(y.data_ptr<float>(), x.data_ptr<float>(), static_cast<const float*>(b));
  else
    run(static_cast<bf16*>(y.data_ptr()), static_cast<const bf16*>(x.data_ptr()), static_cast<const bf16*>(b));
}

// qgemm and qgemm_grouped into a new y [M, N] of x's dtype (one allocation fewer from Python
// on every projection of a decode step).
torch::Tensor qgemm_new(torch::Tensor x, torch::Tensor w, int64_t format, c10::optional<torch::Tensor> bias,
                        bool fixed_order) {
  CHECK_ARG(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D, got ", x.sizes(), " and ", w.sizes());
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  qgemm(y, x, w, format, bias, fixed_order);
  return y;
}

torch::Tensor qgemm_grouped_new(torch::Tensor x, torch::Tensor w, int64_t format, c10::optional<torch::Tensor> bias,
                                int64_t x_bits, int64_t n) {
  CHECK_ARG(x.dim() == 2, "x must be 2-D, got ", x.sizes());
  CHECK_ARG(n > 0 && n < (int64_t(1) << 31), "N must be 1 .. 2^31, got ", n);
  auto y = torch::empty({x.size(0), n}, x.options());
  qgemm_grouped(y, x, w, format, bias, x_bits);
  return y;
}

// W ([N, K / 32 * block_bytes]) regrouped for qgemm_grouped: a new tensor.
torch::Tensor group_rows(torch::Tensor w, int64_t format, int64_t k) {
  check_blocks(w, format, k);
  const int64_t n = w.size(0), groups = (n + q::kGroup - 1) / q::kGroup;
  auto out = torch::empty({groups, w.size(1) * q::kGroup}, torch::TensorOptions().dtype(at::kByte));
  pybind11::gil_scoped_release no_gil;
  q::group_rows_cpu(out.data_ptr<uint8_t>(), w.data_ptr<uint8_t>(), w.size(1), int(format), n, int(k));
  return out;
}

// rows: a 1-D int64 CPU tensor of values in [0, n), made contiguous.
torch::Tensor checked_rows(torch::Tensor rows, int64_t n, at::ScalarType dtype) {
  CHECK_ARG(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1,
            "rows must be a 1-D int64 CPU tensor, got ", rows.scalar_type(), " ", rows.sizes());
  CHECK_ARG(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  rows = rows.contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    CHECK_ARG(r[i] >= 0 && r[i] < n, "row ", r[i], " is out of range [0, ", n, ")");
  return rows;
}

// Rows `rows` ([T] int64, each < N) of W dequantized: [T, K] of `dtype` (float32 or bfloat16).
torch::Tensor dequant_rows(torch::Tensor w, int64_t format, int64_t k, torch::Tensor rows, at::ScalarType dtype) {
  check_blocks(w, format, k);
  rows = checked_rows(rows, w.size(0), dtype);
  const int64_t count = rows.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  auto out = torch::empty({count, k}, torch::TensorOptions().dtype(dtype));
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kFloat)
    q::dequant_rows_cpu(out.data_ptr<float>(), k, w.data_ptr<uint8_t>(), w.size(1), int(format), r, count, int(k));
  else
    q::dequant_rows_cpu(static_cast<bf16*>(out.data_ptr()), k, w.data_ptr<uint8_t>(), w.size(1), int(format), r,
                        count, int(k));
  return out;
}

// The same from a grouped W of n rows.
torch::Tensor dequant_grouped_rows(torch::Tensor w, int64_t format, int64_t k, int64_t n, torch::Tensor rows,
                                   at::ScalarType dtype) {
  check_grouped(w, format, k, n);
  rows = checked_rows(rows, n, dtype);
  const int64_t count = rows.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  auto out = torch::empty({count, k}, torch::TensorOptions().dtype(dtype));
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kFloat)
    q::dequant_grouped_rows_cpu(out.data_ptr<float>(), k, w.data_ptr<uint8_t>(), int(format), r, count, int(k));
  else
    q::dequant_grouped_rows_cpu(static_cast<bf16*>(out.data_ptr()), k, w.data_ptr<uint8_t>(), int(format), r, count,
                                int(k));
  return out;
}

int64_t first_bad_row(torch::Tensor w, int64_t format, int64_t k) {
  check_blocks(w, format, k);
  pybind11::gil_scoped_release no_gil;
  return q::first_bad_row(w.data_ptr<uint8_t>(), w.size(1), int(format), w.size(0), int(k));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("qgemm", &qgemm, "y = x @ W^T (+ bias), W in ggml blocks", py::arg("y"), py::arg("x"), py::arg("w"),
        py::arg("format"), py::arg("bias"), py::arg("fixed_order") = false);
  m.def("qgemm_grouped", &qgemm_grouped, "y = x @ W^T (+ bias), W grouped, x rounded to integers", py::arg("y"),
        py::arg("x"), py::arg("w"), py::arg("format"), py::arg("bias"), py::arg("x_bits"));
  m.def("qgemm_new", &qgemm_new, "qgemm into a new y", py::arg("x"), py::arg("w"), py::arg("format"),
        py::arg("bias"), py::arg("fixed_order") = false);
  m.def("qgemm_grouped_new", &qgemm_grouped_new, "qgemm_grouped into a new y [M, n]", py::arg("x"), py::arg("w"),
        py::arg("format"), py::arg("bias"), py::arg("x_bits"), py::arg("n"));
  m.def("group_rows", &group_rows, "W regrouped for qgemm_grouped", py::arg("w"), py::arg("format"), py::arg("k"));
  m.def("dequant_grouped_rows", &dequant_grouped_rows, "rows of a grouped W dequantized", py::arg("w"),
        py::arg("format"), py::arg("k"), py::arg("n"), py::arg("rows"), py::arg("dtype"));
  m.def("dequant_rows", &dequant_rows, "rows of W dequantized", py::arg("w"), py::arg("format"), py::arg("k"),
        py::arg("rows"), py::arg("dtype"));
  m.def("first_bad_row", &first_bad_row, "first row with a non-finite scale or min, -1 for none");
}
