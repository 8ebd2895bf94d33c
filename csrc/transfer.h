// Shared helpers for the fastpipe::transfer kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <vector>

namespace fastpipe {

// Checks that input `index` of a transfer call is a defined tensor on `kind`.
// Every kernel is reached through dispatch on the inputs' device type, so a
// call must not mix device types (fastpipe.ops.transfer groups them).
inline void check_transfer_input(
    const at::Tensor& t,
    std::size_t index,
    c10::DeviceType kind) {
  TORCH_CHECK(t.defined(), "fastpipe::transfer: tensor ", index, " is undefined");
  TORCH_CHECK(
      t.device().type() == kind,
      "fastpipe::transfer: all tensors of one call must be on the same device type (",
      c10::DeviceTypeName(kind), "), but tensor ", index, " is on ", t.device(),
      "; use fastpipe.ops.transfer, which groups tensors by device type");
}

// Returns a new tensor holding a copy of `t` on `device` (same dtype, never an alias).
inline at::Tensor copy_to(const at::Tensor& t, c10::Device device, bool non_blocking) {
  return t.to(device, t.scalar_type(), non_blocking, /*copy=*/true);
}

#ifdef FASTPIPE_WITH_CUDA
// Copies host tensors to the CUDA `device` on the dedicated host-to-device copy
// stream, ordered before the device's current stream (csrc/cuda/transfer.cpp).
std::vector<at::Tensor> host_to_cuda(
    const std::vector<at::Tensor>& tensors,
    c10::Device device,
    bool non_blocking);
#endif

} // namespace fastpipe
