// CPU kernels of the fused element-wise ops: bias + GELU, bias + dropout +
// residual add, and SwiGLU, each with a backward that recomputes the forward's
// cheap part from the saved inputs (no activations or masks are kept).
//
// float, bfloat16 and half run the SIMD span kernels below in float (reduced-precision
// inputs through small per-thread float blocks); float64 runs plain scalar loops.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <string>
#include <type_traits>

#include "fused_common.h"
#include "fused_simd.h"

namespace fastpipe {
namespace {

using fused::check_features;
using fused::check_same;
using fused::check_vector;
using simd::kWidth;
using simd::vf;

bool is_tanh(c10::string_view approximate) {
  TORCH_CHECK(
      approximate == "none" || approximate == "tanh",
      "fastpipe::bias_gelu: approximate must be 'none' or 'tanh', got '", std::string(approximate),
      "'");
  return approximate == "tanh";
}

// GELU constants, in double (the float64 path) and float (the SIMD path).
constexpr double kSqrtHalfD = 0.70710678118654752440;
constexpr double kInvSqrt2PiD = 0.39894228040143267794;
constexpr double kSqrt2OverPiD = 0.79788456080286535588;
constexpr double kCubicD = 0.044715;
constexpr float kSqrtHalf = float(kSqrtHalfD);
constexpr float kInvSqrt2Pi = float(kInvSqrt2PiD);
constexpr float kSqrt2OverPi = float(kSqrt2OverPiD);
constexpr float kCubic = float(kCubicD);

// --- SIMD span kernels (float) --------------------------------------------------------------
// Each handles `count` consecutive elements from flat index `start`: tensor pointers point at
// element `start`, a bias pointer at feature 0 (the feature of element i is i % n).

// Calls body(k, j, m) over [0, count) in steps of at most kWidth elements inside one row:
// k the offset from start, j the feature index, m the step's length.
template <typename Body>
FASTPIPE_INLINE void bias_steps(int64_t start, int64_t count, int64_t n, const Body& body) {
  int64_t j = start % n;
  for (int64_t k = 0; k < count; j = 0) {
    const int64_t len = std::min(count - k, n - j);
    for (int64_t s = 0; s < len; s += kWidth) {
      body(k + s, j + s, std::min(kWidth, len - s));
    }
    k += len;
  }
}

// Calls body(k, m) over [0, count) in steps of at most kWidth elements.
template <typename Body>
FASTPIPE_INLINE void flat_steps(int64_t count, const Body& body) {
  for (int64_t k = 0; k < count; k += kWidth) {
    body(k, std::min(kWidth, count - k));
  }
}

// 1 / (1 + e**-v), and e**-v in `e` (so 1 - sigmoid = e * sigmoid, without cancellation).
FASTPIPE_INLINE vf sigmoid(vf v, vf& e) {
  e = simd::vexp(-v);
  return 1.0f / (1.0f + e);
}

// tanh form: 0.5 * (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) * (v + 0.044715 v^3).
template <bool Tanh>
FASTPIPE_INLINE vf gelu(vf v) {
  vf gauss;
  if (Tanh) {
    const vf u = kSqrt2OverPi * (v + kCubic * v * v * v);
    return v * sigmoid(2.0f * u, gauss);
  }
  return 0.5f * v * simd::one_plus_erf(v * kSqrtHalf, gauss);
}

template <bool Tanh>
FASTPIPE_INLINE vf gelu_grad(vf v) {
  vf e;
  if (Tanh) {
    const vf u = kSqrt2OverPi * (v + kCubic * v * v * v);
    const vf s = sigmoid(2.0f * u, e);
    const vf du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
    return s + 2.0f * v * (e * s * s) * du; // 0.5 v (1 - tanh^2) du = 2 v s (1 - s) du
  }
  const vf cdf = 0.5f * simd::one_plus_erf(v * kSqrtHalf, e); // e = exp(-v^2 / 2)
  return cdf + v * kInvSqrt2Pi * e;
}

template <bool Tanh>
FASTPIPE_INLINE void bias_gelu_steps(
    const float* x, const float* bias, float* y, int64_t start, int64_t count, int64_t n) {
  bias_steps(start, count, n, [&](int64_t k, int64_t j, int64_t m) __attribute__((always_inline)) {
    simd::store(y + k, gelu<Tanh>(simd::load(x + k, m) + simd::load(bias + j, m)), m);
  });
}

FASTPIPE_SIMD_CLONES void bias_gelu_span(
    const float* x, const float* bias, float* y, int64_t start, int64_t count, int64_t n,
    bool tanh_form) {
  if (tanh_form) {
    bias_gelu_steps<true>(x, bias, y, start, count, n);
  } else {
    bias_gelu_steps<false>(x, bias, y, start, count, n);
  }
}

template <bool Tanh>
FASTPIPE_INLINE void bias_gelu_backward_steps(
    const float* grad, const float* x, const float* bias, float* grad_x, int64_t start,
    int64_t count, int64_t n) {
  bias_steps(start, count, n, [&](int64_t k, int64_t j, int64_t m) __attribute__((always_inline)) {
    const vf v = simd::load(x + k, m) + simd::load(bias + j, m);
    simd::store(grad_x + k, simd::load(grad + k, m) * gelu_grad<Tanh>(v), m);
  });
}

FASTPIPE_SIMD_CLONES void bias_gelu_backward_span(
    const float* grad, const float* x, const float* bias, float* grad_x, int64_t start,
    int64_t count, int64_t n, bool tanh_form) {
  if (tanh_form) {
    bias_gelu_backward_steps<true>(grad, x, bias, grad_x, start, count, n);
  } else {
    bias_gelu_backward_steps<false>(grad, x, bias, grad_x, start, count, n);
  }
}

// Dropout parameters of one call: the mask of element i is keep(key, offset + i, threshold).
struct Dropout {
  uint32_t key;
  uint32_t threshold;
  int64_t offset;
  float scale;
};

FASTPIPE_SIMD_CLONES void bias_dropout_add_span(
    const float* x, const float* bias, const float* residual, float* y, int64_t start,
    int64_t count, int64_t n, Dropout d) {
  bias_steps(start, count, n, [&](int64_t k, int64_t j, int64_t m) __attribute__((always_inline)) {
    const simd::vi keep = simd::keep_mask(d.key, d.offset + start + k, d.threshold);
    const vf kept = (simd::load(x + k, m) + simd::load(bias + j, m)) * d.scale;
    simd::store(y + k, simd::select(keep, kept) + simd::load(residual + k, m), m);
  });
}

FASTPIPE_SIMD_CLONES void dropout_backward_span(
    const float* grad, float* grad_x, int64_t start, int64_t count, Dropout d) {
  flat_steps(count, [&](int64_t k, int64_t m) __attribute__((always_inline)) {
    const simd::vi keep = simd::keep_mask(d.key, d.offset + start + k, d.threshold);
    simd::store(grad_x + k, simd::select(keep, simd::load(grad + k, m) * d.scale), m);
  });
}

FASTPIPE_SIMD_CLONES void swiglu_span(const float* gate, const float* up, float* y, int64_t count) {
  flat_steps(count, [&](int64_t k, int64_t m) __attribute__((always_inline)) {
    const vf g = simd::load(gate + k, m);
    vf e;
    simd::store(y + k, g * sigmoid(g, e) * simd::load(up + k, m), m);
  });
}

FASTPIPE_SIMD_CLONES void swiglu_backward_span(
    const float* grad, const float* gate, const float* up, float* grad_gate, float* grad_up,
    int64_t count) {
  flat_steps(count, [&](int64_t k, int64_t m) __attribute__((always_inline)) {
    const vf g = simd::load(gate + k, m);
    const vf d = simd::load(grad + k, m);
    vf e;
    const vf s = sigmoid(g, e);
    simd::store(grad_up + k, d * g * s, m);
    simd::store(grad_gate + k, d * simd::load(up + k, m) * s * (1.0f + g * (e * s)), m);
  });
}

// --- dtype plumbing -------------------------------------------------------------------------

// Runs kernel(in, out, start, count) in parallel over [0, numel) on float pointers: float
// tensors directly, bfloat16 / half through per-thread float blocks converted on the fly.
template <typename scalar_t, size_t NI, size_t NO, typename K>
void run_float(
    int64_t numel, const std::array<const scalar_t*, NI>& in, const std::array<scalar_t*, NO>& out,
    const K& kernel) {
  at::parallel_for(0, numel, fused::kGrainElements, [&](int64_t begin, int64_t end) {
    std::array<const float*, NI> fin;
    std::array<float*, NO> fout;
    if constexpr (std::is_same_v<scalar_t, float>) {
      for (size_t i = 0; i < NI; ++i) {
        fin[i] = in[i] + begin;
      }
      for (size_t o = 0; o < NO; ++o) {
        fout[o] = out[o] + begin;
      }
      kernel(fin, fout, begin, end - begin);
    } else {
      constexpr int64_t kBlock = 1024;
      float in_buf[NI][kBlock];
      float out_buf[NO][kBlock];
      for (int64_t s = begin; s < end; s += kBlock) {
        const int64_t c = std::min(kBlock, end - s);
        for (size_t i = 0; i < NI; ++i) {
          for (int64_t k = 0; k < c; ++k) {
            in_buf[i][k] = static_cast<float>(in[i][s + k]);
          }
          fin[i] = in_buf[i];
        }
        for (size_t o = 0; o < NO; ++o) {
          fout[o] = out_buf[o];
        }
        kernel(fin, fout, s, c);
        for (size_t o = 0; o < NO; ++o) {
          for (int64_t k = 0; k < c; ++k) {
            out[o][s + k] = static_cast<scalar_t>(out_buf[o][k]);
          }
        }
      }
    }
  });
}

template <size_t N>
using FloatIn = std::array<const float*, N>;
template <size_t N>
using FloatOut = std::array<float*, N>;

// --- float64: scalar loops ------------------------------------------------------------------

double gelu_f64(double v, bool tanh_form) {
  if (tanh_form) {
    const double t = std::tanh(kSqrt2OverPiD * (v + kCubicD * v * v * v));
    return 0.5 * v * (1.0 + t);
  }
  return 0.5 * v * (1.0 + std::erf(v * kSqrtHalfD));
}

double gelu_grad_f64(double v, bool tanh_form) {
  if (tanh_form) {
    const double t = std::tanh(kSqrt2OverPiD * (v + kCubicD * v * v * v));
    const double dinner = kSqrt2OverPiD * (1.0 + 3.0 * kCubicD * v * v);
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dinner;
  }
  return 0.5 * (1.0 + std::erf(v * kSqrtHalfD)) +
      v * kInvSqrt2PiD * std::exp(-0.5 * v * v);
}

double sigmoid_f64(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}

// Runs body(i) for every i in [0, numel) in parallel.
template <typename F>
void for_each_index(int64_t numel, const F& body) {
  at::parallel_for(0, numel, fused::kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      body(i);
    }
  });
}

// --- ops ------------------------------------------------------------------------------------

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
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>) {
      const double* bp = bias.const_data_ptr<double>();
      for_each_index(x.numel(), [&](int64_t i) { op[i] = gelu_f64(xp[i] + bp[i % n], tanh_form); });
    } else {
      const at::Tensor bias_f = bias.to(at::kFloat);
      const float* bp = bias_f.const_data_ptr<float>();
      run_float<scalar_t, 1, 1>(x.numel(), {xp}, {op}, [&](FloatIn<1> i, FloatOut<1> o, int64_t s, int64_t c) {
        bias_gelu_span(i[0], bp, o[0], s, c, n, tanh_form);
      });
    }
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
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_backward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* op = grad_x.mutable_data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>) {
      const double* bp = bias.const_data_ptr<double>();
      for_each_index(x.numel(), [&](int64_t i) {
        op[i] = gp[i] * gelu_grad_f64(xp[i] + bp[i % n], tanh_form);
      });
    } else {
      const at::Tensor bias_f = bias.to(at::kFloat);
      const float* bp = bias_f.const_data_ptr<float>();
      run_float<scalar_t, 2, 1>(x.numel(), {gp, xp}, {op}, [&](FloatIn<2> i, FloatOut<1> o, int64_t s, int64_t c) {
        bias_gelu_backward_span(i[0], i[1], bp, o[0], s, c, n, tanh_form);
      });
    }
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
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = acc_t(1) / (acc_t(1) - acc_t(p));
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = residual.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>) {
      const double* bp = bias.const_data_ptr<double>();
      for_each_index(x.numel(), [&](int64_t i) {
        const double kept = fused::keep(key, offset + i, threshold) ? (xp[i] + bp[i % n]) * scale : 0.0;
        op[i] = kept + rp[i];
      });
    } else {
      const at::Tensor bias_f = bias.to(at::kFloat);
      const float* bp = bias_f.const_data_ptr<float>();
      const Dropout d{key, threshold, offset, static_cast<float>(scale)};
      run_float<scalar_t, 2, 1>(x.numel(), {xp, rp}, {op}, [&](FloatIn<2> i, FloatOut<1> o, int64_t s, int64_t c) {
        bias_dropout_add_span(i[0], bp, i[1], o[0], s, c, n, d);
      });
    }
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
    if constexpr (std::is_same_v<scalar_t, double>) {
      for_each_index(grad.numel(), [&](int64_t i) {
        op[i] = fused::keep(key, offset + i, threshold) ? gp[i] * scale : 0.0;
      });
    } else {
      const Dropout d{key, threshold, offset, static_cast<float>(scale)};
      run_float<scalar_t, 1, 1>(grad.numel(), {gp}, {op}, [&](FloatIn<1> i, FloatOut<1> o, int64_t s, int64_t c) {
        dropout_backward_span(i[0], o[0], s, c, d);
      });
    }
  });
  return grad_x;
}

at::Tensor swiglu_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.device().is_cpu(), "fastpipe::swiglu: gate must be a CPU tensor");
  check_same(gate_in, up_in, "swiglu", "up");
  const at::Tensor gate = gate_in.contiguous();
  const at::Tensor up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu", [&] {
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_p = up.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>) {
      for_each_index(gate.numel(), [&](int64_t i) { op[i] = gp[i] * sigmoid_f64(gp[i]) * up_p[i]; });
    } else {
      run_float<scalar_t, 2, 1>(gate.numel(), {gp, up_p}, {op}, [&](FloatIn<2> i, FloatOut<1> o, int64_t, int64_t c) {
        swiglu_span(i[0], i[1], o[0], c);
      });
    }
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
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_p = up.const_data_ptr<scalar_t>();
    const scalar_t* dp = grad.const_data_ptr<scalar_t>();
    scalar_t* dg = grad_gate.mutable_data_ptr<scalar_t>();
    scalar_t* du = grad_up.mutable_data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>) {
      for_each_index(gate.numel(), [&](int64_t i) {
        const double g = gp[i];
        const double s = sigmoid_f64(g);
        du[i] = dp[i] * g * s;
        dg[i] = dp[i] * up_p[i] * s * (1.0 + g * (1.0 - s));
      });
    } else {
      run_float<scalar_t, 3, 2>(gate.numel(), {dp, gp, up_p}, {dg, du}, [&](FloatIn<3> i, FloatOut<2> o, int64_t, int64_t c) {
        swiglu_backward_span(i[0], i[1], i[2], o[0], o[1], c);
      });
    }
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
