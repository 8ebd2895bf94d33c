"""Argument checks shared by the fused ops: clear, typed errors before any kernel runs."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def tensor(op: str, name: str, value: object) -> Tensor:
    """``value`` if it is a floating-point tensor with at least one dimension, else TypeError."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {value.dtype}; "
                        f"cast it with .float()")
    if value.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least one dimension (features last)")
    return value


def vector(op: str, name: str, value: object, x: Tensor) -> Tensor:
    """``value`` as a feature vector for ``x``: shape ``(x.shape[-1],)``, on x's device, cast to
    x's dtype (autograd records the cast, so mixed-precision weights get their gradients)."""
    value = tensor(op, name, value)
    if value.shape != (x.shape[-1],):
        raise ValueError(f"{op}: {name} has shape {tuple(value.shape)} but x has "
                         f"{x.shape[-1]} features (last dimension); give {name} shape "
                         f"({x.shape[-1]},)")
    _same_device(op, name, value, x)
    return value.to(x.dtype)


def like(op: str, name: str, value: object, x: Tensor, x_name: str = "x") -> Tensor:
    """``value`` if it has ``x``'s shape and device (ValueError otherwise)."""
    value = tensor(op, name, value)
    if value.shape != x.shape:
        raise ValueError(f"{op}: {name} has shape {tuple(value.shape)} but {x_name} has "
                         f"{tuple(x.shape)}; they must match")
    _same_device(op, name, value, x)
    return value


def common_dtype(*tensors: Tensor) -> Tuple[Tensor, ...]:
    """The tensors cast to their promoted dtype (as PyTorch's own element-wise ops would)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return tuple(t.to(dtype) for t in tensors)


def probability(op: str, p: object) -> float:
    """A dropout probability in [0, 1) (ValueError otherwise)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: p must be a float in [0, 1), got {p!r}")
    return float(p)


def non_negative(op: str, name: str, value: object) -> float:
    """A non-negative number such as ``eps`` (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{op}: {name} must be a non-negative number, got {value!r}")
    return float(value)


def _same_device(op: str, name: str, value: Tensor, x: Tensor) -> None:
    if value.device != x.device:
        raise ValueError(f"{op}: {name} is on {value.device} but x is on {x.device}; "
                         f"move it with .to(x.device)")


def sum_to_features(grad: Tensor) -> Tensor:
    """``grad`` summed over every dimension but the last (a bias or weight gradient)."""
    return grad.reshape(-1, grad.shape[-1]).sum(0)
