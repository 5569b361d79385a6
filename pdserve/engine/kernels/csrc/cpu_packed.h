// What the linear kernels (cpu_amx_linear.cpp, cpu_f32_linear.cpp) share: access to a weight that
// oneDNN prepacked (`torch.ops.mkldnn._reorder_linear_weight`), an opaque MkldnnCPU tensor whose
// bytes only oneDNN's own ops can reach.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace pds {

// The packed weight's data, and its size in bytes in `nbytes` (mkldnn::data_ptr, mkldnn::_nbytes).
inline const void* mkldnn_bytes(const at::Tensor& t, int64_t& nbytes) {
  static const auto data_ptr =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
  static const auto size =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
  nbytes = size.call(t);
  return reinterpret_cast<const void*>(data_ptr.call(t));
}

}  // namespace pds
