"""``rms_norm`` and ``layer_norm`` over the last dimension. Backward takes the saved input and
weight and recomputes the row statistics (mean, rstd) in the kernel: nothing else is kept."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _checks
from .backend import call, choose

__all__ = ["layer_norm", "rms_norm"]


def _save(ctx: Any, x: Tensor, weight: Tensor, eps: float, backend: str) -> None:
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.backend = eps, backend


def _rms_grads(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:
    x, weight = ctx.saved_tensors
    grad_x, grad_w = call(ctx.backend, "rms_norm_backward", grad.contiguous(), x, weight, ctx.eps)
    return grad_x, grad_w


def _layer_grads(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    x, weight = ctx.saved_tensors
    grad_x, grad_w, grad_b = call(ctx.backend, "layer_norm_backward", grad.contiguous(), x,
                                  weight, ctx.eps)
    return grad_x, grad_w, grad_b


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
        _save(ctx, x, weight, eps, backend)
        return call(backend, "rms_norm", x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (*_rms_grads(ctx, grad), None, None)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float,
                backend: str) -> Tensor:
        _save(ctx, x, weight, eps, backend)
        return call(backend, "layer_norm", x, weight, bias, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (*_layer_grads(ctx, grad), None, None)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``; saves only ``x`` and ``weight``."""
    x = _checks.tensor("rms_norm", "x", x)
    weight = _checks.vector("rms_norm", "weight", weight, x)
    eps = _checks.non_negative("rms_norm", "eps", eps)
    return _RMSNorm.apply(x, weight, eps, choose(x))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension with affine ``weight`` and ``bias``; saves only ``x``
    and ``weight`` (not the mean or rstd)."""
    x = _checks.tensor("layer_norm", "x", x)
    weight = _checks.vector("layer_norm", "weight", weight, x)
    bias = _checks.vector("layer_norm", "bias", bias, x)
    eps = _checks.non_negative("layer_norm", "eps", eps)
    return _LayerNorm.apply(x, weight, bias, eps, choose(x))


# --- the registered ops: fake impls and autograd -----------------------------------------------


def fake_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def fake_rms_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                      ) -> Tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def fake_layer(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def fake_layer_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                        ) -> Tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def setup_rms(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, weight, eps = inputs
    _save(ctx, x, weight, eps, "native")


def backward_rms(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    return (*_rms_grads(ctx, grad), None)


def setup_layer(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, weight, _, eps = inputs
    _save(ctx, x, weight, eps, "native")


def backward_layer(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    return (*_layer_grads(ctx, grad), None)


FAKES = {"rms_norm": fake_rms, "rms_norm_backward": fake_rms_backward,
         "layer_norm": fake_layer, "layer_norm_backward": fake_layer_backward}
AUTOGRAD = {"rms_norm": (backward_rms, setup_rms), "layer_norm": (backward_layer, setup_layer)}
