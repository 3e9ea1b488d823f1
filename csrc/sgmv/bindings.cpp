// Torch bindings for SGMV: every input is checked here (shape, dtype, device, layout and, for
// host-side metadata, the segment values) and the error names the offending tensor and shape.
// Weight addresses cannot be checked: punica_x.ops.sgmv.SgmvWeights owns the tensors they point to.
#include <torch/extension.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "../common/simd.h"
#include "amx.h"
#include "sgmv.h"

#ifdef PUNICA_X_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using punica_x::SgmvSegments;

constexpr int kMaxSlices = 4;

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "sgmv: ", __VA_ARGS__)

void check_rows(const torch::Tensor& t, const char* name) {
  CHECK_ARG(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  CHECK_ARG(t.stride(1) == 1, name, " must have contiguous rows (stride(1) == 1), got strides ",
            t.strides());
}

void check_vector(const torch::Tensor& t, const char* name, at::ScalarType dtype, int64_t size,
                  const torch::Device& device) {
  CHECK_ARG(t.dim() == 1 && t.size(0) == size, name, " must have shape [", size, "], got ",
            t.sizes());
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
  CHECK_ARG(t.device() == device, name, " must be on ", device, ", got ", t.device());
}

// Validates the segment metadata. On CPU it also checks the values, including the caller's
// bounds max_rows (rows of the longest segment with an adapter) and max_rank (largest rank sum
// of a segment with an adapter);
// on CUDA the values stay on the device and the bounds are trusted (they size the grid).
SgmvSegments check_segments(const torch::Tensor& w_ptr, const torch::Tensor& ranks,
                            const torch::Tensor& seg, int64_t layer, int64_t rows,
                            int64_t max_rows, int64_t max_rank, const torch::Device& device) {
  CHECK_ARG(seg.dim() == 1 && seg.size(0) >= 1, "seg must be 1-D [num_segments + 1], got ",
            seg.sizes());
  const int64_t n = seg.size(0) - 1;
  check_vector(seg, "seg", at::kInt, n + 1, device);
  check_vector(w_ptr, "w_ptr", at::kLong, n, device);
  CHECK_ARG(ranks.dim() == 2 && ranks.size(0) == n, "ranks must be [num_segments=", n,
            ", num_slices], got ", ranks.sizes());
  CHECK_ARG(ranks.size(1) >= 1 && ranks.size(1) <= kMaxSlices, "ranks must have 1..", kMaxSlices,
            " slices, got ", ranks.size(1));
  CHECK_ARG(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.device() == device,
            "ranks must be contiguous int32 on ", device);
  CHECK_ARG(layer >= 0, "layer must be >= 0, got ", layer);
  if (device.is_cpu()) {
    const int32_t* s = seg.data_ptr<int32_t>();
    CHECK_ARG(s[0] >= 0 && s[n] <= rows, "segments must lie in [0, ", rows, "), got seg[0]=", s[0],
              " seg[-1]=", s[n]);
    for (int64_t i = 0; i < n; ++i)
      CHECK_ARG(s[i] <= s[i + 1], "seg must be non-decreasing, seg[", i, "]=", s[i], " > seg[",
                i + 1, "]=", s[i + 1]);
    const int32_t* r = ranks.data_ptr<int32_t>();
    const int64_t slices = ranks.size(1);
    for (int64_t i = 0; i < n; ++i) {
      int64_t sum = 0;
      for (int64_t j = 0; j < slices; ++j) {
        CHECK_ARG(r[i * slices + j] >= 0, "ranks must be >= 0, got ", r[i * slices + j]);
        sum += r[i * slices + j];
      }
      if (w_ptr.data_ptr<int64_t>()[i] == 0) continue;
      CHECK_ARG(sum <= max_rank, "segment ", i, " has rank ", sum, " > max_rank ", max_rank);
      CHECK_ARG(s[i + 1] - s[i] <= max_rows, "segment ", i, " has ", s[i + 1] - s[i],
                " rows > max_rows ", max_rows);
    }
  }
  return SgmvSegments{w_ptr.data_ptr<int64_t>(), ranks.data_ptr<int32_t>(), seg.data_ptr<int32_t>(),
                      static_cast<int>(n), static_cast<int>(ranks.size(1)),
                      static_cast<int>(layer)};
}

using punica_x::simd::bf16;

// The CPU kernels take float32 and bfloat16 x / y, with the adapters' weights in x's dtype or,
// for float32 x, in bfloat16 (punica_x.lora casts them to the pool's dtype at load); CUDA
// kernels take weights in x's dtype only. w_dtype: the weights' dtype, x's when not given.
void check_cpu_dtype(const torch::Tensor& t, const char* name) {
  CHECK_ARG(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
            " must be float32 or bfloat16 on CPU, got ", t.scalar_type());
}

at::ScalarType weights_dtype(const torch::Tensor& x, std::optional<at::ScalarType> w_dtype) {
  const at::ScalarType x_t = x.scalar_type(), w_t = w_dtype.value_or(x_t);
  const bool widened = x.device().is_cpu() && x_t == at::kFloat && w_t == at::kBFloat16;
  CHECK_ARG(w_t == x_t || widened, "adapter weights of dtype ", w_t, " with x of dtype ", x_t,
            ": the weights must be of x's dtype, or bfloat16 with float32 x on the CPU");
  return w_t;
}

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>, Tag<W>) with the kernels' types for x's and the weights' dtypes (CPU)
template <typename F>
void with_cpu_types(at::ScalarType x_t, at::ScalarType w_t, F&& f) {
  if (x_t == at::kBFloat16)
    f(Tag<bf16>{}, Tag<bf16>{});
  else if (w_t == at::kBFloat16)
    f(Tag<float>{}, Tag<bf16>{});
  else
    f(Tag<float>{}, Tag<float>{});
}

#ifdef PUNICA_X_WITH_CUDA
punica_x::DType cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return punica_x::DType::kFloat32;
    case at::kHalf: return punica_x::DType::kFloat16;
    case at::kBFloat16: return punica_x::DType::kBFloat16;
    default: TORCH_CHECK(false, "sgmv: no CUDA kernel for dtype ", t);
  }
}
#endif

// v[t, 0:R_s] = x[t] @ A_s[layer]^T for the rows of every segment s with an adapter. On CUDA
// the rest of v is zeroed too, unless `scratch` (v is add_lora's workspace: expand reads only
// what shrink wrote, so a kernel that writes rather than adds needs no memset first).
void shrink(torch::Tensor v, torch::Tensor x, torch::Tensor w_ptr, torch::Tensor ranks,
            torch::Tensor seg, int64_t layer, int64_t max_rows, int64_t max_rank, bool scratch,
            std::optional<at::ScalarType> w_dtype, bool fixed_order) {
  check_rows(x, "x");
  check_rows(v, "v");
  CHECK_ARG(v.scalar_type() == at::kFloat, "v must be float32, got ", v.scalar_type());
  CHECK_ARG(v.size(0) == x.size(0), "v and x must have the same rows, got v ", v.sizes(), " x ",
            x.sizes());
  CHECK_ARG(v.device() == x.device(), "v and x must be on one device");
  SgmvSegments p =
      check_segments(w_ptr, ranks, seg, layer, x.size(0), max_rows, max_rank, x.device());
  p.fixed_order = fixed_order;
  CHECK_ARG(v.size(1) >= max_rank, "v has ", v.size(1), " columns, the segments need ", max_rank);
  const int h_in = static_cast<int>(x.size(1));
  const at::ScalarType w_t = weights_dtype(x, w_dtype);
  if (x.device().is_cpu()) {
    check_cpu_dtype(x, "x");
    pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
    with_cpu_types(x.scalar_type(), w_t, [&](auto tx, auto tw) {
      using T = typename decltype(tx)::type;
      punica_x::sgmv_shrink_cpu<T, typename decltype(tw)::type>(
          v.data_ptr<float>(), v.stride(0), static_cast<const T*>(x.data_ptr()), x.stride(0), h_in, p);
    });
    return;
  }
#ifdef PUNICA_X_WITH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  const punica_x::DType dtype = cuda_dtype(x.scalar_type());
  if (!scratch || punica_x::sgmv_shrink_accumulates(dtype, static_cast<int>(max_rows), h_in,
                                                    x.data_ptr(), x.stride(0)))
    v.zero_();
  const bool ok = punica_x::sgmv_shrink_cuda(
      dtype, v.data_ptr<float>(), v.stride(0), x.data_ptr(), x.stride(0), h_in, p,
      static_cast<int>(max_rows), static_cast<int>(max_rank),
      c10::cuda::getCurrentCUDAStream().stream());
  CHECK_ARG(ok, "no CUDA shrink kernel for dtype ", x.scalar_type());
#else
  CHECK_ARG(false, "this build has no CUDA kernels (x is on ", x.device(), ")");
#endif
}

void sgmv_shrink(torch::Tensor v, torch::Tensor x, torch::Tensor w_ptr, torch::Tensor ranks,
                 torch::Tensor seg, int64_t layer, int64_t max_rows, int64_t max_rank,
                 std::optional<at::ScalarType> w_dtype, bool fixed_order) {
  shrink(std::move(v), std::move(x), std::move(w_ptr), std::move(ranks), std::move(seg), layer,
         max_rows, max_rank, /*scratch=*/false, w_dtype, fixed_order);
}

// y[t, yoff_j : yoff_j + h_out[j]] += v[t, voff_j : voff_j + r_j] @ B_s,j[layer].
void sgmv_expand(torch::Tensor y, torch::Tensor v, torch::Tensor w_ptr, torch::Tensor ranks,
                 torch::Tensor seg, std::vector<int64_t> h_out, int64_t layer, int64_t max_rows,
                 int64_t max_rank, std::optional<at::ScalarType> w_dtype, bool fixed_order) {
  check_rows(y, "y");
  check_rows(v, "v");
  CHECK_ARG(v.scalar_type() == at::kFloat, "v must be float32, got ", v.scalar_type());
  CHECK_ARG(v.size(0) == y.size(0), "v and y must have the same rows, got v ", v.sizes(), " y ",
            y.sizes());
  CHECK_ARG(v.device() == y.device(), "v and y must be on one device");
  SgmvSegments p =
      check_segments(w_ptr, ranks, seg, layer, y.size(0), max_rows, max_rank, y.device());
  p.fixed_order = fixed_order;
  CHECK_ARG(static_cast<int64_t>(h_out.size()) == ranks.size(1), "h_out has ", h_out.size(),
            " slices, ranks has ", ranks.size(1));
  int32_t h_out32[kMaxSlices];
  int64_t total = 0;
  for (size_t j = 0; j < h_out.size(); ++j) {
    CHECK_ARG(h_out[j] > 0, "h_out[", j, "] must be > 0, got ", h_out[j]);
    h_out32[j] = static_cast<int32_t>(h_out[j]);
    total += h_out[j];
  }
  CHECK_ARG(y.size(1) >= total, "y has ", y.size(1), " columns, the slices need ", total);
  CHECK_ARG(v.size(1) >= max_rank, "v has ", v.size(1), " columns, the segments need ", max_rank);
  const at::ScalarType w_t = weights_dtype(y, w_dtype);
  if (y.device().is_cpu()) {
    check_cpu_dtype(y, "y");
    pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
    with_cpu_types(y.scalar_type(), w_t, [&](auto tx, auto tw) {
      using T = typename decltype(tx)::type;
      punica_x::sgmv_expand_cpu<T, typename decltype(tw)::type>(
          static_cast<T*>(y.data_ptr()), y.stride(0), v.data_ptr<float>(), v.stride(0), h_out32, p);
    });
    return;
  }
#ifdef PUNICA_X_WITH_CUDA
  const c10::cuda::CUDAGuard guard(y.device());
  const bool ok = punica_x::sgmv_expand_cuda(
      cuda_dtype(y.scalar_type()), y.data_ptr(), y.stride(0), v.data_ptr<float>(), v.stride(0),
      h_out32, p, static_cast<int>(max_rows), c10::cuda::getCurrentCUDAStream().stream());
  CHECK_ARG(ok, "no CUDA expand kernel for dtype ", y.scalar_type());
#else
  CHECK_ARG(false, "this build has no CUDA kernels (y is on ", y.device(), ")");
#endif
}

// y += x @ A_s @ B_s per segment: shrink into the float32 workspace v, then expand (one call
// from Python per projection group instead of two).
void sgmv_add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor v, torch::Tensor a_ptr,
                   torch::Tensor b_ptr, torch::Tensor ranks, torch::Tensor seg,
                   std::vector<int64_t> h_out, int64_t layer, int64_t max_rows, int64_t max_rank,
                   std::optional<at::ScalarType> w_dtype, bool fixed_order) {
  shrink(v, x, a_ptr, ranks, seg, layer, max_rows, max_rank, /*scratch=*/true, w_dtype, fixed_order);
  sgmv_expand(y, v, b_ptr, ranks, seg, std::move(h_out), layer, max_rows, max_rank, w_dtype,
              fixed_order);
}

// y += x @ A_s @ B_s for one fixed set of segments and weights on the CPU (one
// punica_x.ops.sgmv_weights.SgmvWeights, built once per step plan and called by every layer):
// the metadata is checked once here, so a call checks only its own tensors and takes four
// arguments instead of eleven (a decode step makes 4 calls per layer).
class CpuLaunch {
 public:
  // layers and h_in: every adapter's layer count and input width (a call's layer must be
  // below the one and its x as wide as the other: the kernels read the weights at addresses
  // they compute from both). The metadata is copied: the caller's tensors may change later.
  CpuLaunch(const torch::Tensor& a_ptr, const torch::Tensor& b_ptr, const torch::Tensor& ranks,
            const torch::Tensor& seg, std::vector<int64_t> h_out, int64_t max_rows, int64_t max_rank,
            int64_t layers, int64_t h_in, py::object keep, std::optional<at::ScalarType> w_dtype,
            bool fixed_order)
      : a_ptr_(a_ptr.clone()), b_ptr_(b_ptr.clone()), ranks_(ranks.clone()), seg_(seg.clone()),
        max_rank_(max_rank), layers_(layers), h_in_(h_in), w_dtype_(w_dtype),
        fixed_order_(fixed_order), keep_(std::move(keep)) {
    CHECK_ARG(layers >= 0 && layers <= INT32_MAX, "layers must be in 0..2^31-1, got ", layers);
    CHECK_ARG(h_in >= 0 && h_in <= INT32_MAX, "h_in must be in 0..2^31-1, got ", h_in);
    const torch::Device cpu(torch::kCPU);
    CHECK_ARG(seg_.device().is_cpu(), "a CPU launch needs its segments on the CPU, got ", seg_.device());
    // the batch's rows are checked per call (against where the segments end)
    check_segments(a_ptr_, ranks_, seg_, 0, INT64_MAX, max_rows, max_rank, cpu);
    check_segments(b_ptr_, ranks_, seg_, 0, INT64_MAX, max_rows, max_rank, cpu);
    rows_ = seg_.data_ptr<int32_t>()[seg_.size(0) - 1];
    CHECK_ARG(static_cast<int64_t>(h_out.size()) == ranks_.size(1), "h_out has ", h_out.size(),
              " slices, ranks has ", ranks_.size(1));
    for (size_t j = 0; j < h_out.size(); ++j) {
      CHECK_ARG(h_out[j] > 0 && h_out[j] <= INT32_MAX, "h_out[", j, "] must be in 1..2^31-1, got ", h_out[j]);
      h_out_[j] = static_cast<int32_t>(h_out[j]);
      total_ += h_out[j];
    }
  }

  void add_lora(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& v, int64_t layer) {
    check_rows(x, "x");
    check_rows(y, "y");
    check_rows(v, "v");
    CHECK_ARG(x.device().is_cpu() && y.device().is_cpu() && v.device().is_cpu(),
              "a CPU launch needs x, y and v on the CPU");
    check_cpu_dtype(x, "x");
    CHECK_ARG(y.scalar_type() == x.scalar_type(), "y must be x's dtype ", x.scalar_type(), ", got ",
              y.scalar_type());
    CHECK_ARG(v.scalar_type() == at::kFloat, "v must be float32, got ", v.scalar_type());
    CHECK_ARG(y.size(0) == x.size(0) && v.size(0) == x.size(0), "x, y and v must have the same rows, got x ",
              x.sizes(), " y ", y.sizes(), " v ", v.sizes());
    CHECK_ARG(rows_ <= x.size(0), "segments must lie in [0, ", x.size(0), "), they end at ", rows_);
    CHECK_ARG(y.size(1) >= total_, "y has ", y.size(1), " columns, the slices need ", total_);
    CHECK_ARG(v.size(1) >= max_rank_, "v has ", v.size(1), " columns, the segments need ", max_rank_);
    CHECK_ARG(layer >= 0 && layer < layers_, "layer must be in 0..", layers_ - 1, ", got ", layer);
    CHECK_ARG(x.size(1) == h_in_ || max_rank_ == 0, "x must have the adapters' ", h_in_, " columns, got ",
              x.size(1));
    const SgmvSegments a = segments(a_ptr_, layer), b = segments(b_ptr_, layer);
    const int h_in = static_cast<int>(x.size(1));
    const at::ScalarType w_t = weights_dtype(x, w_dtype_);
    pybind11::gil_scoped_release no_gil;  // kernels touch no Python state
    with_cpu_types(x.scalar_type(), w_t, [&](auto tx, auto tw) {
      using T = typename decltype(tx)::type;
      using W = typename decltype(tw)::type;
      punica_x::sgmv_shrink_cpu<T, W>(v.data_ptr<float>(), v.stride(0), static_cast<const T*>(x.data_ptr()),
                                      x.stride(0), h_in, a);
      punica_x::sgmv_expand_cpu<T, W>(static_cast<T*>(y.data_ptr()), y.stride(0), v.data_ptr<float>(),
                                      v.stride(0), h_out_, b);
    });
  }

 private:
  SgmvSegments segments(const torch::Tensor& w_ptr, int64_t layer) const {
    return SgmvSegments{w_ptr.data_ptr<int64_t>(), ranks_.data_ptr<int32_t>(), seg_.data_ptr<int32_t>(),
                        static_cast<int>(seg_.size(0) - 1), static_cast<int>(ranks_.size(1)),
                        static_cast<int>(layer), fixed_order_};
  }

  torch::Tensor a_ptr_, b_ptr_, ranks_, seg_;
  int64_t max_rank_ = 0, layers_ = 0, h_in_ = 0, rows_ = 0, total_ = 0;
  std::optional<at::ScalarType> w_dtype_;  // the weights' dtype; x's when not given
  bool fixed_order_ = false;               // SgmvSegments::fixed_order
  int32_t h_out_[kMaxSlices] = {};
  py::object keep_;  // the weights' tensors, which a_ptr_ and b_ptr_ point into
};

// (mode, min_rows) of the AMX tiles path (amx.h) before the call; mode -1 or min_rows 0 leave
// that one as it is. Modes: 0 off, 1 hardware (refused where there is no usable AMX), 2
// emulated (the same code on scalar tiles, for tests; avx512_bf16 builds only).
std::pair<int, int> sgmv_amx(int mode, int min_rows) {
#if defined(PUNICA_X_AMX)
  namespace amx = punica_x::amx;
  CHECK_ARG(mode >= -1 && mode <= amx::kEmulated, "amx mode must be -1, 0, 1 or 2, got ", mode);
  CHECK_ARG(min_rows >= 0, "amx min_rows must be >= 1 (0: unchanged), got ", min_rows);
  CHECK_ARG(mode != amx::kHardware || amx::hardware_permitted(),
            "amx mode 1 (hardware): this CPU or OS gives no AMX-BF16 tiles, or Linux refused this "
            "process the tile state");
  const std::pair<int, int> before{amx::mode(), amx::settings().min_rows.load()};
  if (mode >= 0) amx::settings().mode.store(mode);
  if (min_rows > 0) amx::settings().min_rows.store(min_rows);
  return before;
#else
  CHECK_ARG(mode <= 0 && min_rows >= 0, "amx: this build (", punica_x::simd::kIsa,
            ") has no AMX tiles path; only mode 0 or -1");
  return {0, 0};
#endif
}

// (items run on tiles, tile configurations loaded) since the process started
std::pair<int64_t, int64_t> amx_counts() {
#if defined(PUNICA_X_AMX)
  return {punica_x::amx::settings().items.load(), punica_x::amx::settings().configs.load()};
#else
  return {0, 0};
#endif
}

bool amx_available() {
#if defined(PUNICA_X_AMX)
  return punica_x::amx::hardware_supported();
#else
  return false;
#endif
}

bool has_cuda() {
#ifdef PUNICA_X_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(punica_x::simd::kIsa); }, "instruction set of this build");
  m.def("sgmv_shrink", &sgmv_shrink, "SGMV shrink (see csrc/sgmv/sgmv.h)", py::arg("v"),
        py::arg("x"), py::arg("w_ptr"), py::arg("ranks"), py::arg("seg"), py::arg("layer"),
        py::arg("max_rows"), py::arg("max_rank"), py::arg("w_dtype") = py::none(),
        py::arg("fixed_order") = false);
  m.def("sgmv_expand", &sgmv_expand, "SGMV expand (see csrc/sgmv/sgmv.h)", py::arg("y"),
        py::arg("v"), py::arg("w_ptr"), py::arg("ranks"), py::arg("seg"), py::arg("h_out"),
        py::arg("layer"), py::arg("max_rows"), py::arg("max_rank"), py::arg("w_dtype") = py::none(),
        py::arg("fixed_order") = false);
  m.def("sgmv_add_lora", &sgmv_add_lora, "shrink then expand (see csrc/sgmv/sgmv.h)", py::arg("y"),
        py::arg("x"), py::arg("v"), py::arg("a_ptr"), py::arg("b_ptr"), py::arg("ranks"),
        py::arg("seg"), py::arg("h_out"), py::arg("layer"), py::arg("max_rows"),
        py::arg("max_rank"), py::arg("w_dtype") = py::none(), py::arg("fixed_order") = false);
  py::class_<CpuLaunch>(m, "CpuLaunch", "add_lora for fixed CPU segments and weights, checked once")
      .def(py::init<const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                    std::vector<int64_t>, int64_t,
                    int64_t, int64_t, int64_t, py::object, std::optional<at::ScalarType>, bool>(),
           py::arg("a_ptr"), py::arg("b_ptr"), py::arg("ranks"), py::arg("seg"), py::arg("h_out"),
           py::arg("max_rows"), py::arg("max_rank"), py::arg("layers"), py::arg("h_in"), py::arg("keep"),
           py::arg("w_dtype") = py::none(), py::arg("fixed_order") = false)
      .def("add_lora", &CpuLaunch::add_lora, "y += x @ A_s @ B_s at `layer` (v: float32 workspace)",
           py::arg("y"), py::arg("x"), py::arg("v"), py::arg("layer"));
  m.def("has_cuda", &has_cuda, "whether this build carries the CUDA kernels");
  m.def("sgmv_amx", &sgmv_amx, "set the AMX tiles path's (mode, min_rows); returns the previous",
        py::arg("mode") = -1, py::arg("min_rows") = 0);
  m.def("amx_items", [] { return amx_counts().first; }, "shrink and expand items run on AMX tiles so far (tests)");
  m.def("amx_configs", [] { return amx_counts().second; }, "AMX tile configurations loaded so far (tests)");
  m.def("amx_available", &amx_available,
        "whether this CPU, OS and build can run AMX-BF16 tiles (a probe: asks Linux for nothing; sgmv_amx(1) asks)");
  m.def("max_slices", [] { return kMaxSlices; }, "largest number of slices one launch takes");
}
