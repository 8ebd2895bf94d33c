// fastpipe.PinnedPool (torch.classes.fastpipe.PinnedPool): a pool of host
// buffers for activation offload. Host memory (page-locked when `pinned`, so
// copies to and from a GPU can be asynchronous) is allocated once and handed
// out again: a step offloads the same tensor sizes every time, so after the
// first step no buffer is allocated at all.
//
// acquire(nbytes) returns a uint8 buffer of at least nbytes (at most twice as
// large, so a small tensor never pins a large buffer); release(buffer) gives it
// back. The pool does not know when a device copy into or out of a buffer ends:
// its caller releases a buffer only once no copy uses it any more.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace fastpipe {
namespace {

constexpr int64_t kGranule = 512; // buffer sizes are multiples of this many bytes

int64_t round_up(int64_t nbytes) {
  return (nbytes + kGranule - 1) / kGranule * kGranule;
}

class PinnedPool : public torch::CustomClassHolder {
 public:
  explicit PinnedPool(bool pinned) : pinned_(pinned) {}

  // A host buffer of at least `nbytes` bytes, reused when a free one fits.
  at::Tensor acquire(int64_t nbytes) {
    TORCH_CHECK(nbytes >= 0, "PinnedPool.acquire: nbytes must be >= 0, got ", nbytes);
    const int64_t size = round_up(nbytes > 0 ? nbytes : 1);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.lower_bound(size);
    at::Tensor buffer;
    if (it != free_.end() && it->first <= 2 * size) {
      buffer = it->second;
      free_.erase(it);
    } else {
      buffer = at::empty(
          {size}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned_));
      reserved_ += size;
      ++allocations_;
    }
    in_use_[buffer.data_ptr()] = buffer.numel();
    in_use_bytes_ += buffer.numel();
    return buffer;
  }

  // Gives back a buffer returned by acquire(); its memory may be handed out again.
  void release(const at::Tensor& buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = in_use_.find(buffer.data_ptr());
    TORCH_CHECK(
        it != in_use_.end(),
        "PinnedPool.release: this buffer is not in use from this pool ",
        "(released twice, or not returned by acquire)");
    in_use_bytes_ -= it->second;
    in_use_.erase(it);
    free_.emplace(buffer.numel(), buffer);
  }

  // Frees the buffers nobody uses (memory returns to the host allocator).
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : free_) {
      reserved_ -= entry.first;
    }
    free_.clear();
  }

  // (bytes reserved, bytes in use, buffers allocated so far, buffers free now)
  std::tuple<int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {reserved_, in_use_bytes_, allocations_, static_cast<int64_t>(free_.size())};
  }

  bool pinned() const {
    return pinned_;
  }

 private:
  const bool pinned_;
  std::mutex mutex_;
  std::multimap<int64_t, at::Tensor> free_; // by size in bytes
  std::unordered_map<void*, int64_t> in_use_; // data pointer -> size
  int64_t reserved_ = 0;
  int64_t in_use_bytes_ = 0;
  int64_t allocations_ = 0;
};

} // namespace

TORCH_LIBRARY_FRAGMENT(fastpipe, m) {
  m.class_<PinnedPool>("PinnedPool")
      .def(torch::init<bool>())
      .def("acquire", &PinnedPool::acquire)
      .def("release", &PinnedPool::release)
      .def("empty_cache", &PinnedPool::empty_cache)
      .def("stats", &PinnedPool::stats)
      .def("pinned", &PinnedPool::pinned);
}

} // namespace fastpipe
