"""A load: the checkpoint's entries checked against the model, then read in.

Every destination is built from the checkpoint's own metadata and the live parameters (a
``DTensor`` parameter's state as a ``DTensor`` of its placements), so a load reads the state of
parameters whatever the optimizer held before, and leaves a parameter saved without state
without state, as it was. The hyperparameters and the other small entries are read first (as
data) and checked; then the tensors are read in place.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .errors import CheckpointMismatchError
from .target import Target


class Saved:
    """The checkpoint's metadata, sorted by entry kind and, for the optimizer, by parameter."""

    def __init__(self, metadata: Any, names: List[str]) -> None:
        entries = metadata.state_dict_metadata
        self.entries = entries
        self.model = {k[len("model."):]: md for k, md in entries.items()
                      if k.startswith("model.")}
        known = set(names)
        self.state = _by_parameter(entries, "optim.state.", known)
        self.hyper = _by_parameter(entries, "optim.param_groups.", known)
        self.has_optimizer = any(k.startswith("optim.") for k in entries)


def _by_parameter(entries: Dict[str, Any], prefix: str, known: set
                  ) -> Dict[str, Dict[str, Any]]:
    """``{name: {key: metadata}}`` of the entries under ``prefix`` whose parameter is known."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, md in entries.items():
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix):].split(".")
        for cut in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:cut])
            if name in known:
                out.setdefault(name, {})[".".join(parts[cut:])] = md
                break
    return out


def model_problem(t: Target, saved: Saved) -> Optional[CheckpointMismatchError]:
    """Names of this process's model state the checkpoint lacks, or has at another shape."""
    own = t.model.state_dict()
    missing = sorted(k for k in own if k not in saved.model)
    if missing:
        return CheckpointMismatchError(
            f"the checkpoint lacks {len(missing)} entries of the model, e.g. {missing[:4]}: "
            f"it was saved from another model (or the names changed)")
    wrong = [(k, tuple(v.shape), tuple(saved.model[k].size)) for k, v in own.items()
             if isinstance(v, torch.Tensor) and hasattr(saved.model[k], "size")
             and tuple(v.shape) != tuple(saved.model[k].size)]
    if wrong:
        k, mine, theirs = wrong[0]
        return CheckpointMismatchError(
            f"{len(wrong)} model entries have other shapes in the checkpoint, e.g. {k!r}: "
            f"{theirs} saved, {mine} in this model: it was saved from another model")
    return None


def excess(saved: Saved, held: torch.Tensor) -> Optional[CheckpointMismatchError]:
    """Model entries of the checkpoint that no rank holds (``held``: per sorted saved name)."""
    names = sorted(saved.model)
    extra = [n for n, h in zip(names, held.tolist()) if not h]
    if extra:
        return CheckpointMismatchError(
            f"the checkpoint holds {len(extra)} model entries this model does not have, e.g. "
            f"{extra[:4]}: it was saved from another model")
    return None


def holds(t: Target, saved: Saved) -> torch.Tensor:
    """Which of the checkpoint's model entries (sorted) this process holds."""
    own = t.model.state_dict().keys()
    return torch.tensor([n in own for n in sorted(saved.model)], dtype=torch.uint8)


def optimizer_problem(t: Target, saved: Saved, marker: Dict[str, Any]
                      ) -> Optional[CheckpointMismatchError]:
    """The optimizer given but not saved, or saved without some of its parameters."""
    if t.optimizer is None:
        return None
    if not marker.get("optimizer"):
        return CheckpointMismatchError("optimizer given, but the checkpoint was saved without "
                                       "one; load with optimizer=None")
    missing = [n for n in t.names if n not in saved.hyper]
    if missing:
        return CheckpointMismatchError(
            f"the checkpoint holds no optimizer state for {len(missing)} of the optimizer's "
            f"parameters, e.g. {missing[:4]}: it was saved from another model, or with an "
            f"optimizer over other parameters")
    return None


def small_template(t: Target, saved: Saved, extras: Tuple[str, ...]) -> Dict[str, Any]:
    """The first read: hyperparameters and the small entries (RNG, scheduler, extra), checked
    before the tensors are read into the live model."""
    template: Dict[str, Any] = {key: None for key in extras}
    optim = {f"param_groups.{n}.{k}": _destination(md) for n in t.names
             for k, md in saved.hyper[n].items()}
    if optim:
        template["optim"] = optim
    return template


def hyperparameters(t: Target, read: Dict[str, Any]
                    ) -> Tuple[List[Dict[str, Any]], Optional[CheckpointMismatchError]]:
    """Each live group's saved hyperparameters; an error when the checkpoint gives the
    parameters of one group different values (the optimizer was grouped otherwise)."""
    per_name: Dict[str, Dict[str, Any]] = {}
    for key, value in read.get("optim", {}).items():
        name, hyper = key[len("param_groups."):].rsplit(".", 1)
        per_name.setdefault(name, {})[hyper] = value
    out = []
    for names in t.groups:
        values: Dict[str, Any] = {}
        for name in names:
            for hyper, value in per_name.get(name, {}).items():
                if hyper in values and not _same(values[hyper], value):
                    return [], CheckpointMismatchError(
                        f"the checkpoint gives parameters of one optimizer group different "
                        f"{hyper!r} ({values[hyper]!r} and {value!r} for {name!r}): build the "
                        f"optimizer with the parameter groups it was saved with")
                values[hyper] = value
        out.append(values)
    return out, None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def tensor_template(t: Target, saved: Saved) -> Dict[str, Any]:
    """The second read, in place: the live model's state, and the optimizer state built in
    the shapes and placements the checkpoint and the live parameters give."""
    template: Dict[str, Any] = {"model": t.model.state_dict()}
    if t.optimizer is not None:
        template["optim"] = {f"state.{n}.{k}": _destination(md, t.params[n])
                             for n in t.names for k, md in saved.state.get(n, {}).items()}
    return template


def _destination(md: Any, like: Optional[torch.Tensor] = None) -> Any:
    """Where one entry is read to: a tensor of its shape (the parameter's placement when it
    has the parameter's shape; a scalar, such as a step count, on the CPU: the optimizer's
    load moves it where the optimizer keeps it), or ``None`` for a non-tensor entry."""
    if not hasattr(md, "size"):
        return None
    dtype = md.properties.dtype
    if like is not None and len(md.size) > 0 and tuple(md.size) == tuple(like.shape):
        return torch.empty_like(like, dtype=dtype, requires_grad=False)
    return torch.empty(tuple(md.size), dtype=dtype)


def apply_optimizer(t: Target, read: Dict[str, Any], hyper: List[Dict[str, Any]]) -> None:
    """Load the optimizer from what was read (its state replaced: a parameter saved without
    state has none), with each group's saved hyperparameters."""
    assert t.optimizer is not None
    flat = read.get("optim", {})
    state: Dict[str, Dict[str, Any]] = {}
    for key, value in flat.items():
        name, rest = _split_state_key(key, t.params)
        node = state.setdefault(name, {})
        *path, last = rest.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    groups = [{**{k: v for k, v in live.items() if k != "params"}, **values, "params": names}
              for live, values, names in zip(t.optimizer.param_groups, hyper, t.groups)]
    t.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _split_state_key(key: str, params: Dict[str, Any]) -> Tuple[str, str]:
    parts = key[len("state."):].split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        if name in params:
            return name, ".".join(parts[cut:])
    raise AssertionError(f"no parameter for optimizer entry {key!r}")  # built from params
