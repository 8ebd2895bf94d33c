"""Modules built on the fused recompute ops of ``fastpipe.ops``.

Each keeps the parameter names of its plain PyTorch counterpart (``FusedLayerNorm`` loads an
``nn.LayerNorm`` state dict; ``FusedMLP`` holds two ``nn.Linear``), so a model can switch between
plain and fused layers with the same weights. They save less for backward than the plain layers
(no dropout mask, no normalisation statistics, no activation output) and cost little to
recompute, which is what ``Pipe(checkpoint='selective')`` wants.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops

__all__ = ["FusedLayerNorm", "FusedMLP", "FusedRMSNorm", "FusedSwiGLU"]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_dropout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"dropout must be a float in [0, 1), got {value!r}")
    return float(value)


def _residual_add(module: nn.Module, out: Tensor, bias: Tensor, residual: Optional[Tensor],
                  p: float) -> Tensor:
    """``residual + dropout(out + bias)``, with a zero residual when none is given."""
    residual = torch.zeros_like(out) if residual is None else residual
    return ops.bias_dropout_add(out, bias, residual, p, module.training)


class FusedMLP(nn.Module):
    """Transformer feed-forward: ``residual + dropout(fc2(gelu(fc1(x))))``.

    The biases of ``fc1`` and ``fc2`` are applied inside ``bias_gelu`` and ``bias_dropout_add``,
    so the matrix products run without them. ``forward(x, residual=None)``.
    """

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0,
                 approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(_check_size("dim", dim), _check_size("hidden", hidden))
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = _check_dropout(dropout)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        h = ops.bias_gelu(F.linear(x, self.fc1.weight), self.fc1.bias, self.approximate)
        return _residual_add(self, F.linear(h, self.fc2.weight), self.fc2.bias, residual,
                             self.dropout)


class FusedSwiGLU(nn.Module):
    """SwiGLU feed-forward: ``residual + dropout(down(silu(gate(x)) * up(x)))``."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(_check_size("dim", dim), _check_size("hidden", hidden), bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)
        self.dropout = _check_dropout(dropout)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        h = ops.swiglu(self.gate(x), self.up(x))
        return _residual_add(self, F.linear(h, self.down.weight), self.down.bias, residual,
                             self.dropout)


class FusedRMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale (``weight``, initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(_check_size("dim", dim)))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class FusedLayerNorm(nn.Module):
    """LayerNorm over the last dimension, with the parameters of ``nn.LayerNorm(dim)``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(_check_size("dim", dim)))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)
