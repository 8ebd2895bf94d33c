// CPU kernel of fastpipe::transfer: CPU tensors to any device.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../transfer.h"

namespace fastpipe {
namespace {

// Copies each CPU tensor to `device`; a host-to-CUDA copy runs on the
// destination device's current stream (ATen's copy engine).
std::vector<at::Tensor> transfer_cpu(
    at::TensorList tensors,
    c10::Device device,
    bool non_blocking) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_transfer_input(tensors[i], i, c10::DeviceType::CPU);
    out.push_back(copy_to(tensors[i], device, non_blocking));
  }
  return out;
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CPU, m) {
  m.impl("transfer", &transfer_cpu);
}

} // namespace fastpipe
