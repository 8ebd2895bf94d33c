// Portable SIMD building blocks of the fused CPU kernels: a 16-lane float vector (GCC/Clang
// vector extensions), branch-free exp / erf / sigmoid on it, and the dropout hash on 16
// counters at once.
//
// The vector is 64 bytes wide whatever the target: the compiler lowers it to 4 SSE, 2 AVX2 or
// 1 AVX-512 register. Kernels marked FASTPIPE_SIMD_CLONES are compiled once per instruction set
// and the best one the running CPU supports is picked at load time, so the library needs no
// -march flag. Within one clone a span's padded tail runs the same arithmetic as its full
// vectors, so results do not depend on how the work is split between threads; clones may
// differ in the last bit (the AVX-512 one contracts a * b + c into FMAs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fused_common.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" // 64-byte vectors only cross always-inline calls
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FASTPIPE_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTPIPE_SIMD_CLONES
#endif

#define FASTPIPE_INLINE inline __attribute__((always_inline))

namespace fastpipe {
namespace simd {

constexpr int64_t kWidth = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

FASTPIPE_INLINE vf splat(float a) {
  return vf{} + a;
}

// Loads `m` (<= kWidth) floats from p, the missing lanes set to `fill`.
FASTPIPE_INLINE vf load(const float* p, int64_t m = kWidth, float fill = 0.0f) {
  vf v;
  if (__builtin_expect(m == kWidth, 1)) {
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  float buf[kWidth];
  for (int64_t k = 0; k < kWidth; ++k) {
    buf[k] = k < m ? p[k] : fill;
  }
  std::memcpy(&v, buf, sizeof v);
  return v;
}

// Stores the first `m` (<= kWidth) lanes of v to p.
FASTPIPE_INLINE void store(float* p, vf v, int64_t m = kWidth) {
  if (__builtin_expect(m == kWidth, 1)) {
    std::memcpy(p, &v, sizeof v);
    return;
  }
  float buf[kWidth];
  std::memcpy(buf, &v, sizeof v);
  for (int64_t k = 0; k < m; ++k) {
    p[k] = buf[k];
  }
}

// Lanes summed in a fixed pairwise order.
FASTPIPE_INLINE float hsum(vf v) {
  float a[kWidth];
  std::memcpy(a, &v, sizeof v);
  for (int64_t half = kWidth / 2; half > 0; half /= 2) {
    for (int64_t k = 0; k < half; ++k) {
      a[k] += a[k + half];
    }
  }
  return a[0];
}

// x where mask is all ones, 0 where it is 0.
FASTPIPE_INLINE vf select(vi mask, vf x) {
  return (vf)((vi)x & mask);
}

FASTPIPE_INLINE vf vabs(vf x) {
  return (vf)((vu)x & 0x7fffffffU);
}

// e**x, within about 2 ulp; the argument is clamped to [-87, 88] so the result is always a
// finite normal number (callers rely on that: no inf * 0).
FASTPIPE_INLINE vf vexp(vf x) {
  const float magic = 12582912.0f; // 1.5 * 2**23: adding it rounds to an integer
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  const vi ni = (vi)t - (vi)splat(magic);
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const vf z = r * r;
  const vf p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                  4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;
  return p * (vf)((ni + 127) << 23);
}

// 1 + erf(z) (Abramowitz & Stegun 7.1.26, absolute error below 2e-7, the form ATen's vectorised
// erf uses), computed without cancellation for negative z. Also returns exp(-z*z) in `gauss`.
FASTPIPE_INLINE vf one_plus_erf(vf z, vf& gauss) {
  const vf a = vabs(z);
  const vf t = 1.0f / (a * 0.3275911f + 1.0f);
  const vf poly =
      ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t +
       0.254829592f) * t;
  gauss = vexp(-(a * a));
  const vf erfc = poly * gauss; // erfc(|z|)
  return z < 0.0f ? erfc : 2.0f - erfc;
}

// --- dropout hash: fused_common.h's keep(), 16 counters at once (bit for bit the same) ----------

// Keep mask (all ones where kept, else 0) of the 16 element counters c0, c0 + 1, ..., c0 + 15.
FASTPIPE_INLINE vi keep_mask(uint32_t key, uint64_t c0, uint32_t threshold) {
  const uint32_t lo = static_cast<uint32_t>(c0);
  if (__builtin_expect(lo <= 0xffffffffU - (kWidth - 1), 1)) {
    vu lanes;
    for (int64_t k = 0; k < kWidth; ++k) {
      lanes[k] = static_cast<uint32_t>(k);
    }
    const vu r = fused::mix32(fused::mix32((lanes + lo) ^ key) ^ static_cast<uint32_t>(c0 >> 32));
    // (r >> 8) >= threshold, both below 2**24 + 1: the sign of their difference, as an
    // arithmetic shift (a vector compare of unsigned lanes may not vectorise)
    return ~(((vi)(r >> 8) - static_cast<int32_t>(threshold)) >> 31);
  }
  vi mask; // the low 32 bits wrap inside this vector: element by element
  for (int64_t k = 0; k < kWidth; ++k) {
    mask[k] = fused::keep(key, static_cast<int64_t>(c0 + static_cast<uint64_t>(k)), threshold)
        ? -1 : 0;
  }
  return mask;
}

} // namespace simd
} // namespace fastpipe
