// CPU kernels of the fused element-wise ops: bias + GELU, bias + dropout +
// residual add, and SwiGLU, each with a backward that recomputes the forward's
// cheap part from the saved inputs (no activations or masks are kept).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "fused_common.h"

namespace fastpipe {
namespace {

using fused::check_features;
using fused::check_same;
using fused::check_vector;
using fused::row_grain;
using fused::rows_of;

// Runs `body(row_begin, row_end, features)` over the rows of `x` in parallel.
template <typename F>
void for_rows(const at::Tensor& x, const F& body) {
  const int64_t features = x.dim() == 0 ? 1 : x.size(-1);
  at::parallel_for(0, rows_of(x), row_grain(features), [&](int64_t begin, int64_t end) {
    body(begin, end, features);
  });
}

bool is_tanh(c10::string_view approximate) {
  TORCH_CHECK(
      approximate == "none" || approximate == "tanh",
      "fastpipe::bias_gelu: approximate must be 'none' or 'tanh', got '", std::string(approximate),
      "'");
  return approximate == "tanh";
}

// GELU and its derivative at v, exact (erf) or with the tanh approximation.
template <typename acc_t>
struct Gelu {
  static constexpr acc_t kSqrtHalf = acc_t(0.70710678118654752440);
  static constexpr acc_t kInvSqrt2Pi = acc_t(0.39894228040143267794);
  static constexpr acc_t kSqrt2OverPi = acc_t(0.79788456080286535588);
  static constexpr acc_t kCubic = acc_t(0.044715);

  static acc_t value(acc_t v, bool tanh_form) {
    if (tanh_form) {
      const acc_t t = std::tanh(kSqrt2OverPi * (v + kCubic * v * v * v));
      return acc_t(0.5) * v * (acc_t(1) + t);
    }
    return acc_t(0.5) * v * (acc_t(1) + std::erf(v * kSqrtHalf));
  }

  static acc_t derivative(acc_t v, bool tanh_form) {
    if (tanh_form) {
      const acc_t t = std::tanh(kSqrt2OverPi * (v + kCubic * v * v * v));
      const acc_t dinner = kSqrt2OverPi * (acc_t(1) + acc_t(3) * kCubic * v * v);
      return acc_t(0.5) * (acc_t(1) + t) + acc_t(0.5) * v * (acc_t(1) - t * t) * dinner;
    }
    return acc_t(0.5) * (acc_t(1) + std::erf(v * kSqrtHalf)) +
        v * kInvSqrt2Pi * std::exp(acc_t(-0.5) * v * v);
  }
};

void check_bias_input(const at::Tensor& x, const at::Tensor& bias, const char* op) {
  TORCH_CHECK(x.dim() >= 1, "fastpipe::", op, ": x must have at least one dimension");
  check_features(x, x.size(-1), op, "x");
  check_vector(bias, x.size(-1), x.scalar_type(), op, "bias");
}

at::Tensor bias_gelu_cpu(const at::Tensor& x_in, const at::Tensor& bias_in, c10::string_view approximate) {
  check_bias_input(x_in, bias_in, "bias_gelu");
  const bool tanh_form = is_tanh(approximate);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = bias.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_rows(x, [&](int64_t begin, int64_t end, int64_t n) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const acc_t v = acc_t(xp[r * n + j]) + acc_t(bp[j]);
          op[r * n + j] = scalar_t(Gelu<acc_t>::value(v, tanh_form));
        }
      }
    });
  });
  return out;
}

// Gradient with respect to x (the bias gradient is its sum over the leading dimensions).
at::Tensor bias_gelu_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& bias_in,
    c10::string_view approximate) {
  check_bias_input(x_in, bias_in, "bias_gelu_backward");
  check_same(x_in, grad_in, "bias_gelu_backward", "grad");
  const bool tanh_form = is_tanh(approximate);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor grad_x = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* bp = bias.const_data_ptr<scalar_t>();
    scalar_t* op = grad_x.mutable_data_ptr<scalar_t>();
    for_rows(x, [&](int64_t begin, int64_t end, int64_t n) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t i = r * n + j;
          const acc_t v = acc_t(xp[i]) + acc_t(bp[j]);
          op[i] = scalar_t(acc_t(gp[i]) * Gelu<acc_t>::derivative(v, tanh_form));
        }
      }
    });
  });
  return grad_x;
}

at::Tensor bias_dropout_add_cpu(
    const at::Tensor& x_in, const at::Tensor& bias_in, const at::Tensor& residual_in, double p,
    int64_t seed, int64_t offset) {
  check_bias_input(x_in, bias_in, "bias_dropout_add");
  check_same(x_in, residual_in, "bias_dropout_add", "residual");
  fused::check_dropout_args(p, seed, offset, "bias_dropout_add");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  const at::Tensor residual = residual_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const uint32_t key = fused::seed_key(seed);
  const uint32_t threshold = fused::drop_threshold(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = acc_t(1) / (acc_t(1) - acc_t(p));
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = bias.const_data_ptr<scalar_t>();
    const scalar_t* rp = residual.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_rows(x, [&](int64_t begin, int64_t end, int64_t n) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t i = r * n + j;
          const acc_t kept = fused::keep(key, offset + i, threshold)
              ? (acc_t(xp[i]) + acc_t(bp[j])) * scale
              : acc_t(0);
          op[i] = scalar_t(kept + acc_t(rp[i]));
        }
      }
    });
  });
  return out;
}

// Gradient with respect to x: grad times the regenerated mask, scaled by 1 / (1 - p).
at::Tensor bias_dropout_add_backward_cpu(
    const at::Tensor& grad_in, double p, int64_t seed, int64_t offset) {
  TORCH_CHECK(grad_in.device().is_cpu(), "fastpipe::bias_dropout_add_backward: grad must be a CPU tensor");
  fused::check_dropout_args(p, seed, offset, "bias_dropout_add_backward");
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_x = at::empty_like(grad);
  const uint32_t key = fused::seed_key(seed);
  const uint32_t threshold = fused::drop_threshold(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "bias_dropout_add_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = acc_t(1) / (acc_t(1) - acc_t(p));
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* op = grad_x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, grad.numel(), fused::kGrainElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        op[i] = fused::keep(key, offset + i, threshold) ? scalar_t(acc_t(gp[i]) * scale) : scalar_t(0);
      }
    });
  });
  return grad_x;
}

template <typename acc_t>
inline acc_t sigmoid(acc_t v) {
  return acc_t(1) / (acc_t(1) + std::exp(-v));
}

at::Tensor swiglu_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.device().is_cpu(), "fastpipe::swiglu: gate must be a CPU tensor");
  check_same(gate_in, up_in, "swiglu", "up");
  const at::Tensor gate = gate_in.contiguous();
  const at::Tensor up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_p = up.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), fused::kGrainElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t g = acc_t(gp[i]);
        op[i] = scalar_t(g * sigmoid(g) * acc_t(up_p[i]));
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.device().is_cpu(), "fastpipe::swiglu_backward: gate must be a CPU tensor");
  check_same(gate_in, up_in, "swiglu_backward", "up");
  check_same(gate_in, grad_in, "swiglu_backward", "grad");
  const at::Tensor gate = gate_in.contiguous();
  const at::Tensor up = up_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor grad_gate = at::empty_like(gate);
  at::Tensor grad_up = at::empty_like(up);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_p = up.const_data_ptr<scalar_t>();
    const scalar_t* dp = grad.const_data_ptr<scalar_t>();
    scalar_t* dg = grad_gate.mutable_data_ptr<scalar_t>();
    scalar_t* du = grad_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), fused::kGrainElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t g = acc_t(gp[i]);
        const acc_t s = sigmoid(g);
        const acc_t d = acc_t(dp[i]);
        du[i] = scalar_t(d * g * s);
        dg[i] = scalar_t(d * acc_t(up_p[i]) * s * (acc_t(1) + g * (acc_t(1) - s)));
      }
    });
  });
  return {grad_gate, grad_up};
}

} // namespace

TORCH_LIBRARY_IMPL(fastpipe, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cpu);
  m.impl("bias_dropout_add", &bias_dropout_add_cpu);
  m.impl("bias_dropout_add_backward", &bias_dropout_add_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

} // namespace fastpipe
