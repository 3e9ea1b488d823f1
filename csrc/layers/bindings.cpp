// Torch bindings for the fused CPU layers; every input is checked, errors name the tensor.
#include <torch/extension.h>

#include "../common/simd.h"
#include "fused.h"

namespace {

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "fused: ", __VA_ARGS__)

void check_f32(const torch::Tensor& t, const char* name) {
  CHECK_ARG(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

void check_rows(const torch::Tensor& t, const char* name, int64_t cols) {
  check_f32(t, name);
  CHECK_ARG(t.dim() == 2 && t.size(1) == cols && t.stride(1) == 1, name, " must be [T, ", cols,
            "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(w, "w");
  CHECK_ARG(w.dim() == 1 && w.is_contiguous(), "w must be a contiguous vector");
  const int64_t hidden = w.size(0);
  check_rows(x, "x", hidden);
  auto out = torch::empty({x.size(0), hidden}, x.options());
  pybind11::gil_scoped_release no_gil;
  punica_x::rms_norm_cpu(out.data_ptr<float>(), hidden, x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(),
                         x.size(0), int(hidden), float(eps));
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(w, "w");
  CHECK_ARG(w.dim() == 1 && w.is_contiguous(), "w must be a contiguous vector");
  const int64_t hidden = w.size(0);
  check_rows(x, "x", hidden);
  check_rows(residual, "residual", hidden);
  CHECK_ARG(x.is_contiguous() && residual.is_contiguous() && x.size(0) == residual.size(0),
            "x and residual must be contiguous with the same rows");
  auto out = torch::empty_like(residual);
  pybind11::gil_scoped_release no_gil;
  punica_x::add_rms_norm_cpu(out.data_ptr<float>(), residual.data_ptr<float>(), x.data_ptr<float>(),
                             w.data_ptr<float>(), x.size(0), int(hidden), float(eps));
  return out;
}

// In place on x's `heads` heads per row (x may be a column slice of the fused qkv output).
void rope_(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  check_rows(x, "x", heads * head_dim);
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  CHECK_ARG(head_dim % 2 == 0, "head_dim must be even");
  CHECK_ARG(cos.dim() == 2 && cos.size(1) == head_dim && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                sin.is_contiguous(),
            "cos/sin must be contiguous [max_pos, ", head_dim, "]");
  CHECK_ARG(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                positions.is_contiguous() && positions.size(0) == x.size(0),
            "positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    CHECK_ARG(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the table");
  pybind11::gil_scoped_release no_gil;
  punica_x::rope_cpu(x.data_ptr<float>(), x.stride(0), x.size(0), int(heads), int(head_dim), pos,
                     cos.data_ptr<float>(), sin.data_ptr<float>());
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  CHECK_ARG(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
            "gate_up must be contiguous [T, 2 * inter], got ", gate_up.sizes());
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  pybind11::gil_scoped_release no_gil;
  punica_x::silu_and_mul_cpu(out.data_ptr<float>(), gate_up.data_ptr<float>(), gate_up.size(0), int(inter));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm, "residual += x, return rms_norm(residual)");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("silu_and_mul", &silu_and_mul);
}
