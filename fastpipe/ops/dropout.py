"""``bias_dropout_add``: ``residual + dropout(x + bias)`` in one pass. The dropout mask is never
stored: it is a pure function of ``(seed, offset, element index)`` (see
``fastpipe.ops.reference.dropout_keep``), regenerated in backward and in a recomputation.

Without an explicit ``seed``, each call draws one from the default CPU generator, so
``torch.manual_seed``, ``torch.utils.checkpoint``'s RNG restore and fastpipe's per-micro-batch
RNG replay all reproduce the mask.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _checks
from .backend import call, choose

__all__ = ["bias_dropout_add", "draw_seed"]

OP = "bias_dropout_add"
SEED_LIMIT = 2 ** 62


def draw_seed() -> int:
    """A fresh mask seed from the default CPU generator (so seeding torch fixes it)."""
    return int(torch.randint(0, SEED_LIMIT, (1,)).item())


def _save(ctx: Any, p: float, seed: int, offset: int, backend: str) -> None:
    ctx.p, ctx.seed, ctx.offset, ctx.backend = p, seed, offset, backend


def _grads(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    grad = grad.contiguous()
    grad_x = call(ctx.backend, "bias_dropout_add_backward", grad, ctx.p, ctx.seed, ctx.offset)
    grad_bias = _checks.sum_to_features(grad_x) if ctx.needs_input_grad[1] else None
    return grad_x, grad_bias, grad


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int,
                offset: int, backend: str) -> Tensor:
        _save(ctx, p, seed, offset, backend)
        return call(backend, OP, x, bias, residual, p, seed, offset)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (*_grads(ctx, grad), None, None, None, None)


def bias_dropout_add(x: Tensor, bias: Tensor, residual: Tensor, p: float, training: bool,
                     *, seed: Optional[int] = None, offset: int = 0) -> Tensor:
    """``residual + dropout(x + bias, p)`` (plain ``x + bias + residual`` when not training or
    ``p == 0``). Saves nothing for backward but the seed.

    ``seed`` (in [0, 2**62)) and ``offset`` (the counter of element 0) pick the mask; by
    default the seed is drawn from the default CPU generator.
    """
    x = _checks.tensor(OP, "x", x)
    residual = _checks.like(OP, "residual", residual, x)
    x, residual = _checks.common_dtype(x, residual)
    bias = _checks.vector(OP, "bias", bias, x)
    p = _checks.probability(OP, p)
    if not training or p == 0.0:
        return x + bias + residual
    seed = draw_seed() if seed is None else _seed(seed)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{OP}: offset must be a non-negative int, got {offset!r}")
    return _BiasDropoutAdd.apply(x, bias, residual, p, seed, offset, choose(x))


def _seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{OP}: seed must be an int in [0, 2**62), got {seed!r}")
    return seed


# --- the registered op (torch.ops.fastpipe.bias_dropout_add): fake impl and autograd -----------


def fake(x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int,
         offset: int = 0) -> Tensor:
    return x.new_empty(x.shape)


def fake_backward(grad: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    return grad.new_empty(grad.shape)


def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, _, _, p, seed, *rest = inputs
    _save(ctx, p, seed, rest[0] if rest else 0, "native")


def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    return _grads(ctx, grad) + (None,) * (len(ctx.needs_input_grad) - 3)


FAKES = {"bias_dropout_add": fake, "bias_dropout_add_backward": fake_backward}
AUTOGRAD = {"bias_dropout_add": (backward, setup_context)}
