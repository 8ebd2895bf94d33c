// CUDA kernels of fastpipe::transfer: CUDA tensors to any device, and (through
// host_to_cuda, called by the CPU kernel) host tensors to a CUDA device.
//
// Every cross-device copy of one call runs on a dedicated copy stream of its
// (source, destination) pair, so transfers overlap the compute streams:
//  1. the copy stream waits on an event recorded on the producer's current
//     stream (the source device's, for CUDA sources), so the copy reads
//     finished data;
//  2. the copies are issued on the copy stream; each source is recorded on it,
//     so the caching allocator cannot reuse a source's memory before the copy
//     has read it, even if the caller frees the source right away;
//  3. an event recorded after the last copy is waited on by the consumer
//     stream: the destination's current stream (CUDA destinations) or the
//     source's current stream (host destinations, so that synchronising the
//     usual stream also waits for a non_blocking device-to-host copy); each
//     output is recorded on the consumer stream, which uses it from now on.
// Peer copies (CUDA -> other CUDA device) run on the source device (as ATen's
// copy engine does) with a landing stream of the pair current on the
// destination, which ATen fences both ways with the copy stream.
// Same-device copies are plain copies on the current stream.
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "../transfer.h"

namespace fastpipe {
namespace {

using c10::cuda::CUDAStream;

constexpr c10::DeviceIndex kHost = -1; // the host's index in a (source, destination) pair

// Gives a bare "cuda" device the index of the current CUDA device.
c10::Device resolve_device(c10::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    return c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
  }
  return device;
}

c10::DeviceIndex pair_index(c10::Device device) {
  return device.is_cuda() ? device.index() : kHost;
}

// The streams of one (source, destination) pair: `issue` runs the copies; for a
// peer pair, `land` is current on the destination while they run.
struct CopyStreams {
  std::vector<CUDAStream> streams; // issue first, then land (peer pairs only)

  const CUDAStream& issue() const {
    return streams.front();
  }
  // The stream whose completion means the outputs are written.
  const CUDAStream& done() const {
    return streams.back();
  }
};

// A pool stream of `device`; high priority, so copies are not starved by
// compute, and apart from the low-priority pool the stages' streams come from.
CUDAStream new_copy_stream(c10::DeviceIndex device) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
}

// The dedicated copy streams of the pair (src, dst), created on first use.
const CopyStreams& copy_streams(c10::Device src, c10::Device dst) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, c10::DeviceIndex>, CopyStreams> streams;
  const auto key = std::make_pair(pair_index(src), pair_index(dst));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(key);
  if (it == streams.end()) {
    CopyStreams made;
    made.streams.push_back(new_copy_stream(src.is_cuda() ? src.index() : dst.index()));
    if (src.is_cuda() && dst.is_cuda() && src != dst) {
      made.streams.push_back(new_copy_stream(dst.index()));
    }
    it = streams.emplace(key, std::move(made)).first;
  }
  return it->second;
}

// Makes `consumer` wait for all work queued so far on `producer`.
void stream_wait(const CUDAStream& consumer, const CUDAStream& producer) {
  if (consumer == producer) {
    return;
  }
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(producer.unwrap());
  ready.block(consumer.unwrap());
}

// Tells the caching allocator that `stream` uses `t`'s memory (kept until it is done).
void record_on(const at::Tensor& t, const CUDAStream& stream) {
  if (t.is_cuda() && t.has_storage() && t.storage().data_ptr().get() != nullptr) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  }
}

// Copies `tensors` (all on `src`, which differs from `dst`) on the pair's copy
// streams, with the ordering described at the top of this file.
std::vector<at::Tensor> copy_on_side_stream(
    const std::vector<at::Tensor>& tensors,
    c10::Device src,
    c10::Device dst,
    bool non_blocking) {
  const CopyStreams& pair = copy_streams(src, dst);
  if (src.is_cuda()) {
    stream_wait(pair.issue(), c10::cuda::getCurrentCUDAStream(src.index()));
  }
  const c10::Device consumer_device = dst.is_cuda() ? dst : src;
  const CUDAStream consumer = c10::cuda::getCurrentCUDAStream(consumer_device.index());
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  {
    c10::cuda::CUDAGuard device_guard(consumer_device);
    c10::cuda::CUDAMultiStreamGuard stream_guard(pair.streams);
    for (const at::Tensor& t : tensors) {
      out.push_back(copy_to(t, dst, non_blocking));
      record_on(t, pair.issue());
    }
  }
  stream_wait(consumer, pair.done());
  for (const at::Tensor& o : out) {
    record_on(o, consumer);
  }
  return out;
}

// A same-device copy: an ordinary copy kernel on the current stream.
at::Tensor copy_same_device(const at::Tensor& t, bool non_blocking) {
  c10::cuda::CUDAGuard guard(t.device());
  return copy_to(t, t.device(), non_blocking);
}

std::vector<at::Tensor> transfer_cuda(
    at::TensorList tensors,
    c10::Device device,
    bool non_blocking) {
  const c10::Device dst = resolve_device(device);
  std::vector<at::Tensor> out(tensors.size());
  // Positions of the tensors to move, per source device (a call may mix CUDA devices).
  std::map<c10::DeviceIndex, std::vector<std::size_t>> by_source;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_transfer_input(tensors[i], i, c10::DeviceType::CUDA);
    if (tensors[i].device() == dst) {
      out[i] = copy_same_device(tensors[i], non_blocking);
    } else {
      by_source[tensors[i].device().index()].push_back(i);
    }
  }
  for (const auto& [index, positions] : by_source) {
    std::vector<at::Tensor> group;
    group.reserve(positions.size());
    for (std::size_t i : positions) {
      group.push_back(tensors[i]);
    }
    const c10::Device src(c10::DeviceType::CUDA, index);
    std::vector<at::Tensor> moved = copy_on_side_stream(group, src, dst, non_blocking);
    for (std::size_t k = 0; k < positions.size(); ++k) {
      out[positions[k]] = std::move(moved[k]);
    }
  }
  return out;
}

} // namespace

std::vector<at::Tensor> host_to_cuda(
    const std::vector<at::Tensor>& tensors,
    c10::Device device,
    bool non_blocking) {
  const c10::Device dst = resolve_device(device);
  return copy_on_side_stream(tensors, c10::Device(c10::DeviceType::CPU), dst, non_blocking);
}

TORCH_LIBRARY_IMPL(fastpipe, CUDA, m) {
  m.impl("transfer", &transfer_cuda);
}

} // namespace fastpipe
