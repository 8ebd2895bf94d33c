// CUDA kernel of fastpipe::transfer: CUDA tensors to any device.
//
// Stream semantics, per tensor:
//  * CUDA -> CUDA (other device): the destination's current stream first waits
//    on an event recorded on the source's current stream, so the copy is ordered
//    after everything already queued to produce the source. ATen's copy engine
//    then runs the peer copy on the source's current stream, fenced both ways
//    with the destination's current stream, so work queued afterwards on the
//    destination's current stream sees the data.
//  * CUDA -> CUDA (same device): a plain copy on that device's current stream.
//  * CUDA -> CPU: a device-to-host copy on the source's current stream
//    (pinned output and asynchronous when non_blocking=True).
// In every case the source storage is recorded on the stream that reads it, so
// the caching allocator cannot reuse its memory before the copy completes even
// if the caller frees the source right away.
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../transfer.h"

namespace fastpipe {
namespace {

using c10::cuda::CUDAStream;

// Gives a bare "cuda" device the index of the current CUDA device.
c10::Device resolve_device(c10::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    return c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
  }
  return device;
}

// Makes `consumer` wait for all work queued so far on `producer`.
void stream_wait(const CUDAStream& consumer, const CUDAStream& producer) {
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(producer.unwrap());
  ready.block(consumer.unwrap());
}

// Keeps the source's memory alive in the caching allocator until `reader` is done with it.
void record_reader(const at::Tensor& src, const CUDAStream& reader) {
  if (src.has_storage() && src.storage().data_ptr().get() != nullptr) {
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), reader);
  }
}

// Copies one CUDA tensor to `dst` (already resolved) with the ordering described above.
at::Tensor transfer_one(const at::Tensor& src, c10::Device dst, bool non_blocking) {
  const c10::Device src_device = src.device();
  const CUDAStream src_stream = c10::cuda::getCurrentCUDAStream(src_device.index());
  at::Tensor out;
  if (dst.is_cuda()) {
    c10::cuda::CUDAGuard guard(dst);
    if (src_device != dst) {
      stream_wait(c10::cuda::getCurrentCUDAStream(dst.index()), src_stream);
    }
    out = copy_to(src, dst, non_blocking);
  } else {
    c10::cuda::CUDAGuard guard(src_device);
    out = copy_to(src, dst, non_blocking);
  }
  record_reader(src, src_stream);
  return out;
}

std::vector<at::Tensor> transfer_cuda(
    at::TensorList tensors,
    c10::Device device,
    bool non_blocking) {
  const c10::Device dst = resolve_device(device);
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_transfer_input(tensors[i], i, c10::DeviceType::CUDA);
    out.push_back(transfer_one(tensors[i], dst, non_blocking));
  }
  return out;
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CUDA, m) {
  m.impl("transfer", &transfer_cuda);
}

} // namespace fastpipe
