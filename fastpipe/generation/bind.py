"""A stage's traced forward pointed at this process's tensors of that stage.

The forwards are traced once per pipe (on the model, or on a copy on the ``meta`` device); each
generation binds the graphs of this process's stages to the module's tensors as they are then
(after ``load_state_dict``, casts, optimizer steps: the same objects, or by name), on the stage's
device, so generation reads exactly what the pipe's own forward reads.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from .. import tracing
from .split import StageStep


class BindError(TypeError):
    """A stage's traced forward reads a tensor this process cannot give it."""


def bind(step: StageStep, names: Dict[int, str], module: nn.Module,
         device: torch.device) -> None:
    """Point ``step``'s graph at ``module``'s tensors as they are now (by the name each traced
    tensor has in it; one on another device is copied there: a weight tied across devices) and
    run it on ``device``. Tensors the trace made (constants) are moved there."""
    gm = step.graph
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    if not step.traced:  # first binding: keep the traced tensors, place device constants
        step.traced.update({node.target: _attr(gm, node.target)
                            for node in gm.graph.nodes if node.op == "get_attr"})
        tracing.place_constants(gm, device)
    for target, traced in step.traced.items():
        name = names.get(id(traced))
        if name is None or name not in own:
            value = _constant(traced, target, step.index, device)
        else:
            value = _local(own[name], name, step.index, device)
        _assign(gm, target, value)


def _attr(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _constant(value: Any, target: str, stage: int, device: torch.device) -> torch.Tensor:
    """A tensor the trace made: moved to ``device``; one made on the meta device has no data,
    so only an empty one can be made anew."""
    if not isinstance(value, torch.Tensor):
        raise BindError(f"the traced step of stage {stage} reads {target!r}, which is not a "
                        f"tensor")
    if not value.is_meta:
        return value.to(device)
    if value.numel() != 0:
        raise BindError(f"the traced step of stage {stage} holds a tensor constant {target!r} "
                        f"that the model made from data during its forward; generate traces "
                        f"a model spread over devices (or over ranks) on the meta device and "
                        f"cannot rebuild it: make it a buffer of the module")
    return torch.empty(value.shape, dtype=value.dtype, device=device)


def _local(tensor: torch.Tensor, name: str, stage: int, device: torch.device) -> torch.Tensor:
    if tensor.is_meta:
        raise BindError(f"stage {stage} reads {name!r} during generation, which this process "
                        f"does not hold (it was not materialised for its stages); generation "
                        f"must read the same tensors as the pipe's forward")
    if tensor.device != device:
        return tensor.detach().to(device)
    return tensor


def _assign(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    holder = gm
    for part in path:
        holder = getattr(holder, part)
    holder._parameters.pop(name, None)
    holder._buffers.pop(name, None)
    holder.__dict__.pop(name, None)
    if isinstance(value, nn.Parameter):
        holder.register_parameter(name, value)
    else:
        holder.register_buffer(name, value)
