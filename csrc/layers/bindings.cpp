// Torch bindings for the fused CPU layers; every input is checked, errors name the tensor.
// Tensors are float32 or bfloat16, all of one call in the same dtype.
#include <torch/extension.h>

#include "../common/dispatch.h"
#include "../common/simd.h"
#include "fused.h"

namespace {

using punica_x::simd::bf16;

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "fused: ", __VA_ARGS__)

void check_cpu(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  CHECK_ARG(t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
            name, " must be a float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " on ",
            t.device());
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, " like the other inputs, got ",
            t.scalar_type());
}

void check_rows(const torch::Tensor& t, const char* name, int64_t cols, at::ScalarType dtype) {
  check_cpu(t, name, dtype);
  CHECK_ARG(t.dim() == 2 && t.size(1) == cols && t.stride(1) == 1, name, " must be [T, ", cols,
            "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
}

using punica_x::dispatch;
using punica_x::ptr;

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const auto dtype = x.scalar_type();
  check_cpu(w, "w", dtype);
  CHECK_ARG(w.dim() == 1 && w.is_contiguous(), "w must be a contiguous vector");
  const int64_t hidden = w.size(0);
  check_rows(x, "x", hidden, dtype);
  auto out = torch::empty({x.size(0), hidden}, x.options());
  pybind11::gil_scoped_release no_gil;
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::rms_norm_cpu<T>(ptr<T>(out), hidden, ptr<T>(x), x.stride(0), ptr<T>(w), x.size(0),
                              int(hidden), float(eps));
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const auto dtype = residual.scalar_type();
  check_cpu(w, "w", dtype);
  CHECK_ARG(w.dim() == 1 && w.is_contiguous(), "w must be a contiguous vector");
  const int64_t hidden = w.size(0);
  check_rows(x, "x", hidden, dtype);
  check_rows(residual, "residual", hidden, dtype);
  CHECK_ARG(x.is_contiguous() && residual.is_contiguous() && x.size(0) == residual.size(0),
            "x and residual must be contiguous with the same rows");
  auto out = torch::empty_like(residual);
  pybind11::gil_scoped_release no_gil;
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::add_rms_norm_cpu<T>(ptr<T>(out), ptr<T>(residual), ptr<T>(x), ptr<T>(w), x.size(0),
                                  int(hidden), float(eps));
  });
  return out;
}

// In place on x's `heads` heads per row (x may be a column slice of the fused qkv output).
void rope_(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  const auto dtype = x.scalar_type();
  check_rows(x, "x", heads * head_dim, dtype);
  check_cpu(cos, "cos", dtype);
  check_cpu(sin, "sin", dtype);
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
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    punica_x::rope_cpu<T>(ptr<T>(x), x.stride(0), x.size(0), int(heads), int(head_dim), pos, ptr<T>(cos),
                          ptr<T>(sin));
  });
}

// act(gate) * up over [T, 2 * inter] -> [T, inter]; act: silu or gelu_tanh.
template <bool kGelu>
torch::Tensor act_and_mul(torch::Tensor gate_up) {
  const auto dtype = gate_up.scalar_type();
  check_cpu(gate_up, "gate_up", dtype);
  CHECK_ARG(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
            "gate_up must be contiguous [T, 2 * inter], got ", gate_up.sizes());
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  pybind11::gil_scoped_release no_gil;
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (kGelu)
      punica_x::gelu_tanh_and_mul_cpu<T>(ptr<T>(out), ptr<T>(gate_up), gate_up.size(0), int(inter));
    else
      punica_x::silu_and_mul_cpu<T>(ptr<T>(out), ptr<T>(gate_up), gate_up.size(0), int(inter));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm, "residual += x, return rms_norm(residual)");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("silu_and_mul", &act_and_mul<false>);
  m.def("gelu_tanh_and_mul", &act_and_mul<true>, "gelu (tanh approximation) of gate times up");
}
