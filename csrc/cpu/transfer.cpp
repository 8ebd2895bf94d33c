// CPU kernel of fastpipe::transfer: CPU tensors to any device.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../transfer.h"

namespace fastpipe {
namespace {

// Copies each CPU tensor to `device`. In a CUDA build, host-to-CUDA copies run
// on the dedicated copy stream (host_to_cuda); otherwise ATen's copy engine runs
// them on the destination's current stream.
std::vector<at::Tensor> transfer_cpu(
    at::TensorList tensors,
    c10::Device device,
    bool non_blocking) {
  std::vector<at::Tensor> inputs;
  inputs.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_transfer_input(tensors[i], i, c10::DeviceType::CPU);
    inputs.push_back(tensors[i]);
  }
#ifdef FASTPIPE_WITH_CUDA
  if (device.is_cuda()) {
    return host_to_cuda(inputs, device, non_blocking);
  }
#endif
  std::vector<at::Tensor> out;
  out.reserve(inputs.size());
  for (const at::Tensor& t : inputs) {
    out.push_back(copy_to(t, device, non_blocking));
  }
  return out;
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CPU, m) {
  m.impl("transfer", &transfer_cpu);
}

} // namespace fastpipe
