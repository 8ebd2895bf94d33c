// Shared pieces of the fused recompute kernels (CPU): argument checks, row
// geometry, lane-split reductions and the counter-based dropout hash.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace fastpipe {
namespace fused {

// Elements per parallel_for grain: big enough that thread start-up is amortised.
constexpr int64_t kGrainElements = 32768;
constexpr int kLanes = 8; // independent accumulators, so reductions vectorise

// Checks that `t` is a CPU tensor whose last dimension has `features` entries.
inline void check_features(const at::Tensor& t, int64_t features, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "fastpipe::", op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(
      t.dim() >= 1 && t.size(-1) == features,
      "fastpipe::", op, ": ", name, " must end with a dimension of ", features,
      " features, got shape ", t.sizes());
}

// Checks that `t` is a 1-d vector of `features` entries with dtype `dtype`.
inline void check_vector(
    const at::Tensor& t, int64_t features, at::ScalarType dtype, const char* op, const char* name) {
  TORCH_CHECK(
      t.dim() == 1 && t.size(0) == features, "fastpipe::", op, ": ", name,
      " must have shape (", features, ",), got ", t.sizes());
  TORCH_CHECK(
      t.scalar_type() == dtype, "fastpipe::", op, ": ", name, " has dtype ", t.scalar_type(),
      " but the input has ", dtype, "; cast it to the input's dtype");
}

// Checks that `other` matches `x` in shape and dtype.
inline void check_same(const at::Tensor& x, const at::Tensor& other, const char* op, const char* name) {
  TORCH_CHECK(
      other.sizes() == x.sizes() && other.scalar_type() == x.scalar_type(), "fastpipe::", op, ": ",
      name, " must match the input's shape ", x.sizes(), " and dtype ", x.scalar_type(), ", got ",
      other.sizes(), " ", other.scalar_type());
}

// Rows of a tensor seen as (rows, features), with features its last dimension.
inline int64_t rows_of(const at::Tensor& x) {
  return x.dim() == 0 ? 1 : x.numel() / std::max<int64_t>(x.size(-1), 1);
}

// Row grain for parallel_for: about kGrainElements elements per task.
inline int64_t row_grain(int64_t features) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(features, 1));
}

// Sum over j in [0, n) of f(j), with kLanes accumulators (vectorisable, fixed order).
template <typename acc_t, typename F>
inline acc_t lane_sum(int64_t n, const F& f) {
  acc_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      lanes[k] += f(j + k);
    }
  }
  acc_t total = 0;
  for (; j < n; ++j) {
    total += f(j);
  }
  for (int k = 0; k < kLanes; ++k) {
    total += lanes[k];
  }
  return total;
}

// --- counter-based dropout mask: a pure function of (seed, offset, element index) ----------
// The same arithmetic is written in fastpipe/ops/reference.py and fastpipe/ops/triton_kernels.py;
// the three agree bit for bit. Both multipliers are below 2**31, so a 64-bit signed product of
// a 32-bit value never overflows in the PyTorch reference.
constexpr uint32_t kMul1 = 0x7feb352dU;
constexpr uint32_t kMul2 = 0x2c1b3c6dU;

// One mixing round, on a uint32_t or on a vector of them (fused_simd.h): the same arithmetic
// lane by lane. Always inlined, so each instruction-set clone of a kernel keeps it in its ISA
// (hence no ABI concern in passing 64-byte vectors to it).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <typename U>
inline __attribute__((always_inline)) U mix32(U x) {
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

// The per-call key derived from a 63-bit seed.
inline uint32_t seed_key(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return mix32(static_cast<uint32_t>(s) ^ mix32(static_cast<uint32_t>(s >> 32)));
}

// Keep decision of element counter `c` (= offset + index): 24 random bits against a threshold.
inline bool keep(uint32_t key, int64_t c, uint32_t threshold) {
  const uint64_t u = static_cast<uint64_t>(c);
  const uint32_t r = mix32(mix32(static_cast<uint32_t>(u) ^ key) ^ static_cast<uint32_t>(u >> 32));
  return (r >> 8) >= threshold;
}

// Integer threshold of drop probability p: element dropped when its 24 random bits are below it.
inline uint32_t drop_threshold(double p) {
  return static_cast<uint32_t>(p * 16777216.0);
}

inline void check_dropout_args(double p, int64_t seed, int64_t offset, const char* op) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fastpipe::", op, ": p must be in [0, 1), got ", p);
  TORCH_CHECK(seed >= 0, "fastpipe::", op, ": seed must be non-negative, got ", seed);
  TORCH_CHECK(offset >= 0, "fastpipe::", op, ": offset must be non-negative, got ", offset);
}

} // namespace fused
} // namespace fastpipe
