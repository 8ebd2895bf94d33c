"""Pure-PyTorch forms of the fused ops: the oracle the kernels are tested against, and the
fallback when neither the native library nor Triton can run.

Forward functions are plain compositions of PyTorch ops (autograd can differentiate them
directly). Each ``*_backward`` has the signature of the kernel it stands for: it takes the
forward's inputs and recomputes what it needs, as the fused kernels do.

The dropout mask is a pure function of ``(seed, offset, element index)``: a 32-bit integer hash
written here with int64 tensor arithmetic, and identically in C++ (csrc/cpu/fused_common.h) and
Triton (``fastpipe.ops.triton_kernels``), so all three agree bit for bit.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "bias_dropout_add", "bias_dropout_add_backward", "bias_gelu", "bias_gelu_backward",
    "drop_threshold", "dropout_keep", "layer_norm", "layer_norm_backward", "mix32",
    "rms_norm", "rms_norm_backward", "seed_key", "swiglu", "swiglu_backward",
]

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D  # both below 2**31: a product with a 32-bit value fits in int64
MUL2 = 0x2C1B3C6D


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer mixing function on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """``mix32`` on a Python int (for the per-call key)."""
    return int(mix32(torch.tensor([x & MASK32], dtype=torch.int64)).item())


def seed_key(seed: int) -> int:
    """The 32-bit key of a call, derived from its 63-bit seed."""
    return _mix32_int((seed & MASK32) ^ _mix32_int(seed >> 32))


def drop_threshold(p: float) -> int:
    """An element is dropped when its 24 random bits fall below this integer."""
    return int(p * 16777216.0)


def dropout_keep(shape: torch.Size, p: float, seed: int, offset: int,
                 device: torch.device) -> Tensor:
    """The boolean keep mask of a tensor of ``shape`` (row-major element order)."""
    count = torch.arange(shape.numel(), dtype=torch.int64, device=device) + offset
    r = mix32(mix32((count & MASK32) ^ seed_key(seed)) ^ (count >> 32))
    return ((r >> 8) >= drop_threshold(p)).reshape(shape)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (as the kernels' accumulators)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """GELU of ``x + bias`` (exact, or the tanh approximation)."""
    return F.gelu(x + bias, approximate=approximate)


def bias_dropout_add(x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int,
                     offset: int = 0) -> Tensor:
    """``residual + dropout(x + bias)`` with the counter-based mask, scaled by 1 / (1 - p)."""
    keep = dropout_keep(x.shape, p, seed, offset, x.device)
    dtype = _compute_dtype(x)
    dropped = torch.where(keep, (x.to(dtype) + bias.to(dtype)) * (1.0 / (1.0 - p)), 0.0)
    return (dropped + residual.to(dtype)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, computed in float32 (or float64) then cast back."""
    xf = x.to(_compute_dtype(x))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def _vjp(fn, grad: Tensor, *inputs: Tensor) -> Tuple[Tensor, ...]:
    """Gradients of ``fn(*inputs)`` for ``grad``, by recomputing the forward with autograd."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, grad)


def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """Gradient of :func:`bias_gelu` with respect to ``x``."""
    return _vjp(lambda v: F.gelu(v + bias, approximate=approximate), grad, x)[0]


def bias_dropout_add_backward(grad: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    """Gradient of :func:`bias_dropout_add` with respect to ``x``: the regenerated mask."""
    keep = dropout_keep(grad.shape, p, seed, offset, grad.device)
    scaled = grad.to(_compute_dtype(grad)) * (1.0 / (1.0 - p))
    return torch.where(keep, scaled, 0.0).to(grad.dtype)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                      ) -> Tuple[Tensor, Tensor]:
    """Gradients of :func:`rms_norm` with respect to ``x`` and ``weight``."""
    gx, gw = _vjp(lambda v, w: rms_norm(v, w, eps), grad, x, weight)
    return gx, gw


def layer_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                        ) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`layer_norm` with respect to ``x``, ``weight`` and ``bias``."""
    bias = torch.zeros_like(weight)
    gx, gw, gb = _vjp(lambda v, w, b: layer_norm(v, w, b, eps), grad, x, weight, bias)
    return gx, gw, gb


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """Gradients of :func:`swiglu` with respect to ``gate`` and ``up``."""
    gg, gu = _vjp(swiglu, grad, gate, up)
    return gg, gu
