"""Messages between stages: a pytree value shipped to the receiving stage's device and put in
its mailbox under the key the lowering gives (the receiving side's ``Comm``). ``step`` below is
the step's ``StepState`` (not imported: the step module imports this one).

The one place that turns values into messages and back; the step handlers, the skip-connection
exchange and the distributed transport (which encodes a message's structure) all use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from .device_copy import Parcel, land, ship

TENSOR = object()  # marks where a tensor sits among a message's leaves
BARE = object()  # the spec of a value that is a single tensor (the common case, kept fast)


@dataclass
class Message:
    """A pytree sent between stages: its structure, its constants and its shipped tensors."""

    spec: Any
    constants: List[Any]
    parcel: Parcel
    requires_grad: List[bool]


def flatten(value: Any) -> Tuple[List[Any], Any]:
    """The leaves of ``value`` and its spec (:data:`BARE` for a single tensor)."""
    if isinstance(value, torch.Tensor):
        return [value], BARE
    return pytree.tree_flatten(value)


def unflatten(leaves: List[Any], spec: Any) -> Any:
    return leaves[0] if spec is BARE else pytree.tree_unflatten(leaves, spec)


def post(step: Any, dst: int, key: Hashable, value: Any, detach: bool,
         differentiable: bool = False) -> None:
    """Ship ``value`` to virtual stage ``dst`` under ``key``. ``differentiable`` marks
    floating-point tensors as wanting a gradient even without a graph (a checkpointed forward
    ran without one)."""
    if isinstance(value, torch.Tensor):  # the common single-tensor boundary
        _post_tensor(step, dst, key, value, detach, differentiable)
        return
    leaves, spec = flatten(value)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    flags = [t.requires_grad or (differentiable and (t.is_floating_point() or t.is_complex()))
             for t in tensors]
    if detach:
        tensors = [t.detach() for t in tensors]
    parcel = ship(tensors, step.config.stages[dst].device)
    constants = [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    step.mailboxes[dst].put(key, Message(spec, constants, parcel, flags))


def _post_tensor(step: Any, dst: int, key: Hashable, value: torch.Tensor, detach: bool,
                 differentiable: bool) -> None:
    """``post`` of a bare tensor, without the pytree round trip."""
    flag = value.requires_grad or (differentiable
                                   and (value.is_floating_point() or value.is_complex()))
    parcel = ship([value.detach() if detach else value], step.config.stages[dst].device)
    step.mailboxes[dst].put(key, Message(BARE, [TENSOR], parcel, [flag]))


def post_grads(step: Any, dst: int, key: Hashable,
               grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Ship gradients (a flat list, ``None`` kept) to virtual stage ``dst`` under ``key``."""
    parcel = ship(grads, step.config.stages[dst].device)
    step.mailboxes[dst].put(key, Message(None, [], parcel, []))


def take(step: Any, stage: Any, key: Hashable) -> Message:
    """The message under ``key`` in ``stage``'s mailbox, its tensors landed on its device."""
    message = step.mailboxes[stage.index].take(key)
    message.parcel.tensors = land(message.parcel, stage.device)
    return message


def as_leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A received tensor as a leaf of the receiving stage's graph."""
    grad_ok = requires_grad and (t.is_floating_point() or t.is_complex())
    return t.detach().requires_grad_(grad_ok)
