"""What a checkpoint holds, under the plain model's names: the entries a rank saves.

The entries (``torch.distributed.checkpoint`` keys):

- ``model.<name>``: the model's ``state_dict()`` (on a ``DistributedPipe`` each rank's share,
  tensor-parallel and FSDP parameters as ``DTensor`` shards);
- ``optim.state.<name>.<key>`` and ``optim.param_groups.<name>.<hyperparameter>``: the optimizer,
  flattened as ``torch.distributed.checkpoint.state_dict`` flattens it
  (``flatten_optimizer_state_dict=True``), ``<name>`` the parameter's name in the plain model's
  ``named_parameters()``; a parameter without optimizer state has no ``state`` entries;
- ``scheduler``: the LR scheduler's ``state_dict()``; ``extra``: rank 0's ``extra``;
  ``rng.<rank>``: each rank's torch CPU and CUDA generator states (one ``torch.save`` entry
  each, read back with ``weights_only=True``: ``extra`` holds data only, and a scheduler
  whose state holds other objects loads only with ``trust_pickled=True``).

The optimizer is read from its ``state`` and ``param_groups`` directly (not through its
``state_dict()``), so saving never initialises an optimizer that has not stepped.
"""
from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any, Dict, Optional

import torch
from torch import nn

from .data_only import TRUST_HINT, UnsafeCheckpointError, refusal_reason
from .errors import CheckpointMismatchError
from .target import Target

_SKIPPED_HYPER = ("params", "param_names")  # rank-local: the live group keeps its own


def to_save(t: Target, extra: Optional[Dict[str, Any]], rank: int) -> Dict[str, Any]:
    """This rank's entries of the checkpoint."""
    state: Dict[str, Any] = {"model": t.model.state_dict(), f"rng.{rank}": pack(rng_state())}
    if t.optimizer is not None:
        state["optim"] = flat_optimizer(t)
    if t.scheduler is not None:
        state["scheduler"] = pack(t.scheduler.state_dict())
    if extra is not None and rank == 0:
        state["extra"] = pack(extra)
    return state


def flat_optimizer(t: Target) -> Dict[str, Any]:
    """The optimizer's state and hyperparameters per parameter, under plain names."""
    flat: Dict[str, Any] = {}
    assert t.optimizer is not None
    for group, names in zip(t.optimizer.param_groups, t.groups):
        hyper = {k: v for k, v in group.items() if k not in _SKIPPED_HYPER}
        for param, name in zip(group["params"], names):
            for key, value in _flatten(t.optimizer.state.get(param, {})).items():
                flat[f"state.{name}.{key}"] = value
            for key, value in hyper.items():
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def _flatten(state: Dict[Any, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def rng_state() -> Dict[str, Any]:
    """The torch CPU generator's state and, where CUDA is in use, every device's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"cpu": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
            if cuda else []}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        for i, value in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(value, i)


def pack(value: Any) -> bytes:
    """One opaque checkpoint entry (tensors inside allowed)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(value: Any, what: str, trust_pickled: bool = False) -> Any:
    """An entry :func:`pack` wrote, read with ``torch.load(..., weights_only=True)`` (data:
    numbers, strings, containers, tensors); an entry that needs more is refused, naming
    ``what``, unless the caller trusts the checkpoint (``trust_pickled``: the one place a
    checkpoint entry is unpickled without restriction, at the caller's explicit request)."""
    if not isinstance(value, bytes):
        raise CheckpointMismatchError(f"the checkpoint's {what} is not an entry of "
                                      f"fastpipe.checkpoint.save (a {type(value).__name__})")
    try:
        return torch.load(io.BytesIO(value), weights_only=True)
    except pickle.UnpicklingError as error:
        if not trust_pickled:
            raise UnsafeCheckpointError(
                f"the checkpoint's {what} needs arbitrary unpickling, which a load does not "
                f"do ({refusal_reason(error)}); {TRUST_HINT}") from None
    return torch.load(io.BytesIO(value), weights_only=False)  # trust_pickled: the caller's


def check_extra(extra: Any, where: str = "extra") -> None:
    """``TypeError`` unless ``extra`` holds only what a data-only load reads back: numbers,
    strings, bools, None, lists, tuples, dicts, tensors (and dtypes, devices, sizes)."""
    if type(extra) in (list, tuple):
        for i, item in enumerate(extra):
            check_extra(item, f"{where}[{i}]")
        return
    if type(extra) in (dict, OrderedDict):
        for key, item in extra.items():
            if not isinstance(key, _KEYS):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {_HOLDS}")
            check_extra(item, f"{where}[{key!r}]")
        return
    if not isinstance(extra, _LEAVES) or (isinstance(extra, torch.Tensor)
                                          and type(extra) not in (torch.Tensor, nn.Parameter)):
        raise TypeError(f"{where} is a {type(extra).__name__}: {_HOLDS}")


_KEYS = (str, int, float, bool, type(None))
_LEAVES = (*_KEYS, complex, torch.Tensor, torch.dtype, torch.device, torch.Size)
_HOLDS = ("extra holds numbers, strings, bools, None, lists, tuples, dicts and tensors (what a "
          "checkpoint reads back as data, without unpickling code); store other objects as "
          "such values (e.g. their state_dict())")
