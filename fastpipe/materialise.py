"""Large models: build on the ``meta`` device, give memory only to what this process keeps.

A model built under ``torch.device('meta')`` has parameters with shapes but no storage. A
``DistributedPipe`` rank materialises only its own stages: each submodule holding a tensor the
rank uses is emptied onto the rank's device (``to_empty``) and initialised, by the user's
``init_weights(submodule)`` (a Hugging Face model's ``_init_weights``, say) or else by the
submodule's own ``reset_parameters()``. Parameters shared by several submodules (an embedding and
the LM head) stay one parameter. Traced stages (``fastpipe.tracing``) are then pointed at the new
tensors. Loading a checkpoint afterwards gives every rank the same weights. A module whose tensors
have moved since it was traced is traced again on meta twins of them (:func:`meta_twins`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

InitWeights = Optional[Callable[[nn.Module], Any]]


def check_init_weights(init_weights: Any) -> InitWeights:
    """``init_weights``: ``None`` or a function of one submodule."""
    if init_weights is not None and not callable(init_weights):
        raise TypeError(f"init_weights must be a function of one submodule (e.g. a Hugging Face "
                        f"model's _init_weights), got {init_weights!r}")
    return init_weights


def initialise(module: nn.Module, init_weights: InitWeights) -> None:
    """Initialise the tensors ``module`` holds itself (not its children's): ``init_weights``,
    else its ``reset_parameters``; a module with tensors and neither is an error."""
    if init_weights is not None:
        init_weights(module)
        return
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            reset()
            return
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    if own:
        raise TypeError(f"{type(module).__name__} was built on the meta device but has no "
                        f"reset_parameters() to initialise its own tensors; pass "
                        f"init_weights=... (e.g. model._init_weights for a Hugging Face model), "
                        f"or give it a reset_parameters(), or pass layer factories")


def is_meta(module: nn.Module) -> bool:
    """Whether any of the module's parameters or buffers lives on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialise_layer(layer: nn.Module, device: torch.device, init_weights: InitWeights) -> None:
    """A whole meta layer onto ``device``, every submodule initialised."""
    layer.to_empty(device=device)
    for sub in layer.modules():
        initialise(sub, init_weights)


def materialise_used(module: nn.Module, parts: Sequence[nn.Module], device: torch.device,
                     init_weights: InitWeights) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Give memory on ``device`` to the meta tensors of ``module`` that ``parts`` (its layers, or
    traced stages reading its tensors) use, initialise them, and point ``parts`` at them.
    Returns (meta tensor, its replacement) pairs; holding the meta tensors keeps their ids
    unique, so a caller may match its own references by ``id`` while it holds the pairs."""
    used = {id(t) for part in parts for t in [*part.parameters(), *part.buffers()]}
    homes: Dict[int, List[Tuple[nn.Module, str]]] = {}  # old tensor -> where it lives
    old: Dict[int, torch.Tensor] = {}  # held to the end: their ids are not reused meanwhile
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) in used and tensor.is_meta:
                    homes.setdefault(id(tensor), []).append((sub, name))
                    old[id(tensor)] = tensor
    owners = list({id(sub): sub for places in homes.values() for sub, _ in places}.values())
    for sub in owners:
        sub.to_empty(device=device, recurse=False)
    new: Dict[int, torch.Tensor] = {}
    for key, places in homes.items():  # a tensor held in several places stays one tensor
        first, name = places[0]
        new[key] = getattr(first, name)
        for sub, other in places[1:]:
            setattr(sub, other, new[key])
    for sub in owners:
        initialise(sub, init_weights)
    for part in parts:
        _rebind(part, new)
        part.to(device)  # the device constants of traced graphs follow
    return [(old[key], new[key]) for key in new]


def _rebind(part: nn.Module, new: Dict[int, torch.Tensor]) -> None:
    """Point every attribute of ``part`` that held an old tensor at its new one."""
    for sub in part.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) in new:
                    table[name] = new[id(tensor)]


Layout = Dict[str, Tuple[torch.device, torch.dtype]]


def tensor_layout(module: nn.Module) -> Layout:
    """The device and dtype of each of the module's parameters and buffers, by name."""
    return {name: (t.device, t.dtype) for name, t in _named_tensors(module)}


@contextlib.contextmanager
def meta_twins(module: nn.Module, layout: Layout) -> Iterator[None]:
    """For the block, every parameter and buffer of ``module`` is a meta tensor of its shape and
    of the dtype ``layout`` gives its name (its own otherwise): what tracing reads when the
    module's tensors are on several devices (a rank's own on its device, the others' still on
    the meta device). A tensor held in several places stays one tensor."""
    dtypes = {id(t): layout.get(name, (t.device, t.dtype))[1]
              for name, t in _named_tensors(module)}
    twins: Dict[int, torch.Tensor] = {}
    saved: List[Tuple[Dict[str, Any], str, torch.Tensor]] = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in twins:
                    twins[id(tensor)] = _twin(tensor, dtypes[id(tensor)])
                saved.append((table, key, tensor))
                table[key] = twins[id(tensor)]
    try:
        yield
    finally:
        for table, key, tensor in reversed(saved):
            table[key] = tensor


def _twin(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    twin = torch.empty_like(tensor, device="meta", dtype=dtype)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(twin, requires_grad=tensor.requires_grad)
    return twin


def _named_tensors(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False)]
