// CPU kernels of the fused normalisations over the last dimension: RMSNorm and
// LayerNorm. Backward takes the saved input (not the output, mean or rstd) and
// recomputes the row statistics, which costs extra passes over a row (from cache).
//
// float, bfloat16 and half run the SIMD row kernels below in float (reduced-precision rows
// through per-thread float buffers); float64 runs plain scalar loops.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fused_common.h"
#include "fused_simd.h"

namespace fastpipe {
namespace {

using fused::lane_sum;

void check_norm_input(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  TORCH_CHECK(x.dim() >= 1, "fastpipe::", op, ": x must have at least one dimension");
  fused::check_features(x, x.size(-1), op, "x");
  fused::check_vector(weight, x.size(-1), x.scalar_type(), op, "weight");
  TORCH_CHECK(eps >= 0.0, "fastpipe::", op, ": eps must be non-negative, got ", eps);
}

// --- SIMD row kernels (float) ---------------------------------------------------------------

using simd::kWidth;
using simd::vf;

struct Stats {
  float mean; // 0 for RMSNorm
  float rstd;
};

// Sum over [0, n) of term(j, m) (a vector of the m <= kWidth values from j, padded with
// zeros), with four vector accumulators in a fixed order: several loads in flight, and a
// result that does not depend on the data's alignment or on threading.
template <typename Term>
FASTPIPE_INLINE float vsum(int64_t n, const Term& term) {
  vf a0{}, a1{}, a2{}, a3{};
  int64_t j = 0;
  for (; j + 4 * kWidth <= n; j += 4 * kWidth) {
    a0 += term(j, kWidth);
    a1 += term(j + kWidth, kWidth);
    a2 += term(j + 2 * kWidth, kWidth);
    a3 += term(j + 3 * kWidth, kWidth);
  }
  for (; j < n; j += kWidth) {
    a0 += term(j, std::min(kWidth, n - j));
  }
  return simd::hsum((a0 + a1) + (a2 + a3));
}

// The two sums over [0, n) of the pair term(j, m) returns, in one pass (same fixed order as
// vsum, with two vector accumulators per sum).
template <typename Term>
FASTPIPE_INLINE std::pair<float, float> vsum2(int64_t n, const Term& term) {
  vf a0{}, a1{}, b0{}, b1{};
  int64_t j = 0;
  for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
    const std::pair<vf, vf> t0 = term(j, kWidth);
    const std::pair<vf, vf> t1 = term(j + kWidth, kWidth);
    a0 += t0.first;
    b0 += t0.second;
    a1 += t1.first;
    b1 += t1.second;
  }
  for (; j < n; j += kWidth) {
    const std::pair<vf, vf> t = term(j, std::min(kWidth, n - j));
    a0 += t.first;
    b0 += t.second;
  }
  return {simd::hsum(a0 + a1), simd::hsum(b0 + b1)};
}

// Mean (when Centre) and reciprocal standard deviation of one row.
template <bool Centre>
FASTPIPE_INLINE Stats simd_row_stats(const float* x, int64_t n, float eps) {
  float mean = 0.0f;
  if (Centre) {
    mean = vsum(n, [&](int64_t j, int64_t m) __attribute__((always_inline)) {
      return simd::load(x + j, m);
    }) / float(n);
  }
  const float var = vsum(n, [&](int64_t j, int64_t m) __attribute__((always_inline)) {
    const vf d = simd::load(x + j, m, mean) - mean; // padding adds 0
    return d * d;
  }) / float(n);
  return {mean, 1.0f / std::sqrt(var + eps)};
}

template <bool Centre>
FASTPIPE_INLINE void simd_forward_rows(
    const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    const Stats st = simd_row_stats<Centre>(row, n, eps);
    for (int64_t j = 0; j < n; j += kWidth) {
      const int64_t m = std::min(kWidth, n - j);
      vf v = (simd::load(row + j, m) - st.mean) * st.rstd * simd::load(w + j, m);
      if (Centre) {
        v += simd::load(b + j, m);
      }
      simd::store(y + r * n + j, v, m);
    }
  }
}

// y = (x - mean) * rstd * w (+ b) for `rows` rows; LayerNorm (with b) when centre.
FASTPIPE_SIMD_CLONES void norm_forward_rows(
    const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t n, float eps,
    bool centre) {
  if (centre) {
    simd_forward_rows<true>(x, w, b, y, rows, n, eps);
  } else {
    simd_forward_rows<false>(x, w, nullptr, y, rows, n, eps);
  }
}

template <bool Centre>
FASTPIPE_INLINE void simd_backward_rows(
    const float* g, const float* x, const float* w, float* gx, float* pw, float* pb, int64_t rows,
    int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float* gr = g + r * n;
    const Stats st = simd_row_stats<Centre>(xr, n, eps);
    // dy = g * w (0 in the padding); xhat = (x - mean) * rstd; both means in one pass
    const std::pair<float, float> sums =
        vsum2(n, [&](int64_t j, int64_t m) __attribute__((always_inline)) {
          const vf xhat = (simd::load(xr + j, m, st.mean) - st.mean) * st.rstd;
          const vf dy = simd::load(gr + j, m) * simd::load(w + j, m);
          return std::make_pair(dy * xhat, dy);
        });
    const float mean_dy_xhat = sums.first / float(n);
    const float mean_dy = Centre ? sums.second / float(n) : 0.0f;
    for (int64_t j = 0; j < n; j += kWidth) {
      const int64_t m = std::min(kWidth, n - j);
      __builtin_prefetch(xr + n + j); // the next row, one cache line per step
      __builtin_prefetch(gr + n + j);
      const vf xhat = (simd::load(xr + j, m) - st.mean) * st.rstd;
      const vf gv = simd::load(gr + j, m);
      const vf dy = gv * simd::load(w + j, m);
      simd::store(gx + r * n + j, st.rstd * (dy - mean_dy - xhat * mean_dy_xhat), m);
      simd::store(pw + j, simd::load(pw + j, m) + gv * xhat, m);
      if (Centre) {
        simd::store(pb + j, simd::load(pb + j, m) + gv, m);
      }
    }
  }
}

// Input gradient of `rows` rows; their weight (and, when centre, bias) gradients added to
// pw (and pb).
FASTPIPE_SIMD_CLONES void norm_backward_rows(
    const float* g, const float* x, const float* w, float* gx, float* pw, float* pb, int64_t rows,
    int64_t n, float eps, bool centre) {
  if (centre) {
    simd_backward_rows<true>(g, x, w, gx, pw, pb, rows, n, eps);
  } else {
    simd_backward_rows<false>(g, x, w, gx, pw, nullptr, rows, n, eps);
  }
}

// Copies `n` values converted to To.
template <typename To, typename From>
void convert(const From* from, To* to, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    to[j] = static_cast<To>(from[j]);
  }
}

// --- float64: scalar loops ------------------------------------------------------------------

// Row statistics: mean (0 for RMSNorm) and reciprocal standard deviation.
template <typename scalar_t, typename acc_t>
inline std::pair<acc_t, acc_t> row_stats(const scalar_t* x, int64_t n, acc_t eps, bool centre) {
  acc_t mean = 0;
  if (centre) {
    mean = lane_sum<acc_t>(n, [&](int64_t j) { return acc_t(x[j]); }) / acc_t(n);
  }
  const acc_t var = lane_sum<acc_t>(n, [&](int64_t j) {
    const acc_t d = acc_t(x[j]) - mean;
    return d * d;
  }) / acc_t(n);
  return {mean, acc_t(1) / std::sqrt(var + eps)};
}

// y = (x - mean) * rstd * weight (+ bias), rows in parallel.
template <typename scalar_t>
void norm_forward_scalar(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, double eps,
    at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = x.size(-1);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* wp = weight.const_data_ptr<scalar_t>();
  const scalar_t* bp = bias ? bias->const_data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, fused::rows_of(x), fused::row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = xp + r * n;
      const std::pair<acc_t, acc_t> stats = row_stats<scalar_t, acc_t>(row, n, acc_t(eps), bp != nullptr);
      const acc_t mean = stats.first;
      const acc_t rstd = stats.second;
      for (int64_t j = 0; j < n; ++j) {
        const acc_t y = (acc_t(row[j]) - mean) * rstd * acc_t(wp[j]);
        op[r * n + j] = scalar_t(bp ? y + acc_t(bp[j]) : y);
      }
    }
  });
}

// Input gradient of rows [begin, end), their weight (and bias) gradients added to pw (and pb).
template <typename scalar_t, typename acc_t>
void norm_backward_scalar_rows(
    const scalar_t* xp, const scalar_t* gp, const scalar_t* wp, scalar_t* gxp, acc_t* pw,
    acc_t* pb, int64_t begin, int64_t end, int64_t n, double eps, bool centre) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* row = xp + r * n;
    const scalar_t* g = gp + r * n;
    const std::pair<acc_t, acc_t> stats = row_stats<scalar_t, acc_t>(row, n, acc_t(eps), centre);
    const acc_t mean = stats.first;
    const acc_t rstd = stats.second;
    // dy = g * w; xhat = (x - mean) * rstd
    const acc_t mean_dy_xhat = lane_sum<acc_t>(n, [&](int64_t j) {
      return acc_t(g[j]) * acc_t(wp[j]) * (acc_t(row[j]) - mean) * rstd;
    }) / acc_t(n);
    const acc_t mean_dy = centre
        ? lane_sum<acc_t>(n, [&](int64_t j) { return acc_t(g[j]) * acc_t(wp[j]); }) / acc_t(n)
        : acc_t(0);
    for (int64_t j = 0; j < n; ++j) {
      const acc_t xhat = (acc_t(row[j]) - mean) * rstd;
      const acc_t dy = acc_t(g[j]) * acc_t(wp[j]);
      gxp[r * n + j] = scalar_t(rstd * (dy - mean_dy - xhat * mean_dy_xhat));
      pw[j] += acc_t(g[j]) * xhat;
      if (pb) {
        pb[j] += acc_t(g[j]);
      }
    }
  }
}

// --- drivers --------------------------------------------------------------------------------

// Forward of every row, in parallel: float64 scalar, the rest through the float SIMD kernel.
template <typename scalar_t>
void norm_forward(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, double eps,
    at::Tensor& out) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    norm_forward_scalar<double>(x, weight, bias, eps, out);
  } else {
    const int64_t n = x.size(-1);
    const at::Tensor w = weight.to(at::kFloat);
    const at::Tensor b = bias ? bias->to(at::kFloat) : at::Tensor();
    const float* wp = w.const_data_ptr<float>();
    const float* bp = bias ? b.const_data_ptr<float>() : nullptr;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, fused::rows_of(x), fused::row_grain(n), [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        norm_forward_rows(xp + begin * n, wp, bp, op + begin * n, end - begin, n, feps, bias != nullptr);
      } else {
        std::vector<float> xrow(n), yrow(n);
        for (int64_t r = begin; r < end; ++r) {
          convert(xp + r * n, xrow.data(), n);
          norm_forward_rows(xrow.data(), wp, bp, yrow.data(), 1, n, feps, bias != nullptr);
          convert(yrow.data(), op + r * n, n);
        }
      }
    });
  }
}

// Input gradients of rows [begin, end), their weight (and bias) gradients added to pw (and pb).
template <typename scalar_t, typename acc_t>
void norm_backward_block(
    const scalar_t* xp, const scalar_t* gp, const scalar_t* wp, const float* wf, scalar_t* gxp,
    acc_t* pw, acc_t* pb, int64_t begin, int64_t end, int64_t n, double eps, bool centre) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    norm_backward_scalar_rows<double, double>(xp, gp, wp, gxp, pw, pb, begin, end, n, eps, centre);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    norm_backward_rows(gp + begin * n, xp + begin * n, wf, gxp + begin * n, pw, pb, end - begin, n,
                       static_cast<float>(eps), centre);
  } else {
    std::vector<float> xrow(n), grow(n), gxrow(n);
    for (int64_t r = begin; r < end; ++r) {
      convert(xp + r * n, xrow.data(), n);
      convert(gp + r * n, grow.data(), n);
      norm_backward_rows(grow.data(), xrow.data(), wf, gxrow.data(), pw, pb, 1, n,
                         static_cast<float>(eps), centre);
      convert(gxrow.data(), gxp + r * n, n);
    }
  }
}

// out[j] = sum over blocks of partial[block * n + j], in block order.
template <typename scalar_t, typename acc_t>
void reduce_blocks(const std::vector<acc_t>& partial, int64_t blocks, int64_t n, at::Tensor& out) {
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  for (int64_t j = 0; j < n; ++j) {
    acc_t total = 0;
    for (int64_t block = 0; block < blocks; ++block) {
      total += partial[block * n + j];
    }
    op[j] = scalar_t(total);
  }
}

// Input gradient per row, and weight (and bias) gradients summed over rows. Rows are split
// into one fixed block per thread, each with its own partial sums, so the result does not
// depend on scheduling.
template <typename scalar_t>
void norm_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps, bool centre,
    at::Tensor& grad_x, at::Tensor& grad_w, at::Tensor* grad_b) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = x.size(-1);
  const int64_t rows = fused::rows_of(x);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  std::vector<acc_t> partial_w(blocks * n, acc_t(0));
  std::vector<acc_t> partial_b(grad_b ? blocks * n : 0, acc_t(0));
  const at::Tensor w_float = weight.to(at::kFloat);
  const float* wf = w_float.const_data_ptr<float>();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const scalar_t* wp = weight.const_data_ptr<scalar_t>();
  scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t block = block_begin; block < block_end; ++block) {
      acc_t* pw = partial_w.data() + block * n;
      acc_t* pb = grad_b ? partial_b.data() + block * n : nullptr;
      norm_backward_block<scalar_t, acc_t>(
          xp, gp, wp, wf, gxp, pw, pb, rows * block / blocks, rows * (block + 1) / blocks, n, eps,
          centre);
    }
  });
  reduce_blocks<scalar_t>(partial_w, blocks, n, grad_w);
  if (grad_b) {
    reduce_blocks<scalar_t>(partial_b, blocks, n, *grad_b);
  }
}

// Forward of either norm: LayerNorm when `bias` is given (its input checked), RMSNorm otherwise.
at::Tensor norm_op(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor* bias_in,
                   double eps, const char* op) {
  check_norm_input(x_in, weight_in, eps, op);
  if (bias_in) {
    fused::check_vector(*bias_in, x_in.size(-1), x_in.scalar_type(), op, "bias");
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm", [&] {
    norm_forward<scalar_t>(x, weight, bias_in ? &bias : nullptr, eps, out);
  });
  return out;
}

// Backward of either norm: the input and weight gradients, and the bias gradient when `centre`
// (LayerNorm; an undefined tensor otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_op(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& weight_in, double eps,
    bool centre, const char* op) {
  check_norm_input(x_in, weight_in, eps, op);
  fused::check_same(x_in, grad_in, op, "grad");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w = at::empty_like(weight);
  at::Tensor grad_b = centre ? at::empty_like(weight) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_backward", [&] {
    norm_backward<scalar_t>(grad, x, weight, eps, centre, grad_x, grad_w,
                            centre ? &grad_b : nullptr);
  });
  return {grad_x, grad_w, grad_b};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_op(x, weight, nullptr, eps, "rms_norm");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto grads = norm_backward_op(grad, x, weight, eps, false, "rms_norm_backward");
  return {std::get<0>(grads), std::get<1>(grads)};
}

at::Tensor layer_norm_cpu(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return norm_op(x, weight, &bias, eps, "layer_norm");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_backward_op(grad, x, weight, eps, true, "layer_norm_backward");
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("layer_norm", &layer_norm_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
}

} // namespace fastpipe
