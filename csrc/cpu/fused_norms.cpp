// CPU kernels of the fused normalisations over the last dimension: RMSNorm and
// LayerNorm. Backward takes the saved input (not the output, mean or rstd) and
// recomputes the row statistics, which costs one extra pass over a row.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "fused_common.h"

namespace fastpipe {
namespace {

using fused::lane_sum;

void check_norm_input(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  TORCH_CHECK(x.dim() >= 1, "fastpipe::", op, ": x must have at least one dimension");
  fused::check_features(x, x.size(-1), op, "x");
  fused::check_vector(weight, x.size(-1), x.scalar_type(), op, "weight");
  TORCH_CHECK(eps >= 0.0, "fastpipe::", op, ": eps must be non-negative, got ", eps);
}

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
void norm_forward(
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
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  const scalar_t* wp = weight.const_data_ptr<scalar_t>();
  scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t block = block_begin; block < block_end; ++block) {
      acc_t* pw = partial_w.data() + block * n;
      acc_t* pb = grad_b ? partial_b.data() + block * n : nullptr;
      for (int64_t r = rows * block / blocks; r < rows * (block + 1) / blocks; ++r) {
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
  });
  reduce_blocks<scalar_t>(partial_w, blocks, n, grad_w);
  if (grad_b) {
    reduce_blocks<scalar_t>(partial_b, blocks, n, *grad_b);
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_input(x_in, weight_in, eps, "rms_norm");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_forward<scalar_t>(x, weight, nullptr, eps, out);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_input(x_in, weight_in, eps, "rms_norm_backward");
  fused::check_same(x_in, grad_in, "rms_norm_backward", "grad");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w = at::empty_like(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward", [&] {
    norm_backward<scalar_t>(grad, x, weight, eps, false, grad_x, grad_w, nullptr);
  });
  return {grad_x, grad_w};
}

at::Tensor layer_norm_cpu(
    const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& bias_in, double eps) {
  check_norm_input(x_in, weight_in, eps, "layer_norm");
  fused::check_vector(bias_in, x_in.size(-1), x_in.scalar_type(), "layer_norm", "bias");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm", [&] {
    norm_forward<scalar_t>(x, weight, &bias, eps, out);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_input(x_in, weight_in, eps, "layer_norm_backward");
  fused::check_same(x_in, grad_in, "layer_norm_backward", "grad");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w = at::empty_like(weight);
  at::Tensor grad_b = at::empty_like(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_backward", [&] {
    norm_backward<scalar_t>(grad, x, weight, eps, true, grad_x, grad_w, &grad_b);
  });
  return {grad_x, grad_w, grad_b};
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("layer_norm", &layer_norm_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
}

} // namespace fastpipe
