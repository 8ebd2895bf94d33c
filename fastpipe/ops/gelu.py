"""``bias_gelu``: GELU of ``x + bias`` in one pass; backward recomputes ``x + bias`` and the
GELU derivative from the saved inputs instead of keeping the sum or the output."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _checks
from .backend import call, choose

__all__ = ["bias_gelu"]

OP = "bias_gelu"
APPROXIMATIONS = ("none", "tanh")


def _save(ctx: Any, x: Tensor, bias: Tensor, approximate: str, backend: str) -> None:
    ctx.save_for_backward(x, bias)
    ctx.approximate, ctx.backend = approximate, backend


def _grads(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    x, bias = ctx.saved_tensors
    grad_x = call(ctx.backend, "bias_gelu_backward", grad.contiguous(), x, bias, ctx.approximate)
    grad_bias = _checks.sum_to_features(grad_x) if ctx.needs_input_grad[1] else None
    return grad_x, grad_bias


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor, approximate: str, backend: str) -> Tensor:
        _save(ctx, x, bias, approximate, backend)
        return call(backend, OP, x, bias, approximate)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (*_grads(ctx, grad), None, None)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x + bias)`` with ``bias`` broadcast over the last dimension of ``x``.

    ``approximate``: ``'none'`` (exact, erf) or ``'tanh'``, as in ``torch.nn.functional.gelu``.
    Saves only ``x`` and ``bias`` for backward.
    """
    x = _checks.tensor(OP, "x", x)
    bias = _checks.vector(OP, "bias", bias, x)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{OP}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _BiasGelu.apply(x, bias, approximate, choose(x))


# --- the registered op (torch.ops.fastpipe.bias_gelu): fake impl and autograd -----------------


def fake(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    return x.new_empty(x.shape)


def fake_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    return x.new_empty(x.shape)


def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, bias, *rest = inputs
    _save(ctx, x, bias, rest[0] if rest else "none", "native")


def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    grads = _grads(ctx, grad)
    return grads + (None,) * (len(ctx.needs_input_grad) - 2)


FAKES = {"bias_gelu": fake, "bias_gelu_backward": fake_backward}
AUTOGRAD = {"bias_gelu": (backward, setup_context)}
