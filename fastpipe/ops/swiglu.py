"""``swiglu``: ``silu(gate) * up`` in one pass; backward recomputes the sigmoid from the saved
``gate`` and ``up`` instead of keeping ``silu(gate)`` as well."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _checks
from .backend import call, choose

__all__ = ["swiglu"]

OP = "swiglu"


def _save(ctx: Any, gate: Tensor, up: Tensor, backend: str) -> None:
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _grads(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = call(ctx.backend, "swiglu_backward", grad.contiguous(), gate, up)
    return grad_gate, grad_up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, backend: str) -> Tensor:
        _save(ctx, gate, up, backend)
        return call(backend, OP, gate, up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (*_grads(ctx, grad), None)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` for tensors of one shape (the SwiGLU feed-forward's gating)."""
    gate = _checks.tensor(OP, "gate", gate)
    up = _checks.like(OP, "up", up, gate, "gate")
    gate, up = _checks.common_dtype(gate, up)
    return _SwiGLU.apply(gate, up, choose(gate))


# --- the registered op (torch.ops.fastpipe.swiglu): fake impl and autograd ---------------------


def fake(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape)


def fake_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _save(ctx, *inputs, "native")


def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:
    return _grads(ctx, grad)


FAKES = {"swiglu": fake, "swiglu_backward": fake_backward}
AUTOGRAD = {"swiglu": (backward, setup_context)}
