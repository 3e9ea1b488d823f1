// Helpers of the CPU bindings (they include torch/extension.h): dispatch on a float32 /
// bfloat16 dtype, and a tensor's data as a typed pointer.
#pragma once

#include <torch/extension.h>

#include "simd.h"

namespace punica_x {

// f(pointer cast to T*) for T the storage type of `dtype`: float for float32, simd::bf16
// otherwise (the caller has checked that dtype is one of the two).
template <typename F>
void dispatch(at::ScalarType dtype, const F& f) {
  if (dtype == at::kFloat)
    f(static_cast<float*>(nullptr));
  else
    f(static_cast<simd::bf16*>(nullptr));
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace punica_x
