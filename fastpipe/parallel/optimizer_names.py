"""A ``DistributedPipe`` optimizer's own ``state_dict()``, keyed by the plain model's names.

torch's ``Optimizer.state_dict()`` keys each parameter by its index in that optimizer. The
optimizers of a ``DistributedPipe``'s ranks hold different parameters under the same indices,
and ``torch.distributed.checkpoint`` keeps one copy of what several ranks save under one key, so
every rank's state is merged into one. Once fastpipe has seen an optimizer of a pipe's
parameters (at its first ``step()``), its ``state_dict()`` keys the parameters by their
plain-model names (a tied weight by its first name, on every rank that holds a copy): a state
dict torch's ``load_state_dict`` still reads, and whose entries are now distinct across ranks.
Its ``load_state_dict`` maps the names back to this optimizer's parameters, refusing the state
of parameters it does not hold.

A load can also reach an optimizer before fastpipe has seen it (one that never stepped): torch
then maps the entries by position, and ``torch.distributed.checkpoint`` reads only what the
(stateless) template asks for. For that case each group's learning rate is saved as a float
carrying the names of the group's parameters and which of them had state
(:class:`RecordedLr`): it is the one value such a load keeps, and the optimizer's first step
checks it (another rank's groups, or state that was not read) before anything changes.
``torch.distributed.checkpoint.state_dict`` maps indices to names itself: its calls get torch's
format.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_TORCH_HELPERS = "torch.distributed.checkpoint.state_dict"

_pipes: "weakref.WeakSet[Any]" = weakref.WeakSet()
_seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook: List[Any] = []  # the global step pre-hook's handle, once registered


class OptimizerStateError(ValueError):
    """An optimizer state dict that is not this rank's (another rank's entries), or one whose
    state a load left out; raised before the optimizer changes."""


class RecordedLr(float):
    """A saved group's learning rate, carrying the names of the group's parameters
    (``names``) and of those that had state (``stateful``)."""

    names: List[str]
    stateful: List[str]

    def __new__(cls, value: float, names: Sequence[str], stateful: Sequence[str]) -> "RecordedLr":
        lr = super().__new__(cls, value)
        lr.names, lr.stateful = list(names), list(stateful)
        return lr

    def __reduce__(self) -> Any:
        return RecordedLr, (float(self), self.names, self.stateful)

    def __repr__(self) -> str:
        return float.__repr__(self)


torch.serialization.add_safe_globals([RecordedLr])  # torch.load(weights_only=True) reads it


def watch(pipe: Any) -> None:
    """Key the state dicts of optimizers of ``pipe``'s parameters by plain names from their
    first step on (``pipe._checkpoint_names()`` names each local parameter)."""
    _pipes.add(pipe)
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _seen:
        attach(optimizer)


def attach(optimizer: torch.optim.Optimizer) -> bool:
    """Check what a positional load left in ``optimizer``'s groups, then key its state dicts by
    name (once). ``False``: not an optimizer of a watched pipe's parameters only; torch's
    format is kept."""
    if optimizer in _seen:
        return True
    pipe = _owner(optimizer)
    if pipe is None:
        _seen.add(optimizer)
        return False
    names = _names(optimizer, pipe)
    held = {n for group, own in zip(optimizer.param_groups, names)
            for p, n in zip(group["params"], own) if optimizer.state.get(p)}
    _check_records([g.get("lr") for g in optimizer.param_groups], names, held, positional=True)
    _plain_lrs(optimizer.param_groups)  # checked: from now on, every step may run
    _seen.add(optimizer)
    ref = weakref.ref(pipe)
    optimizer.register_state_dict_post_hook(lambda opt, sd: _by_name(opt, sd, ref))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: _from_names(opt, sd, ref))
    return True


def _owner(optimizer: torch.optim.Optimizer) -> Optional[Any]:
    """The watched pipe all of whose parameters the optimizer holds, if any."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for pipe in list(_pipes):
        mine = {id(p) for p in pipe.parameters()}
        if held and held <= mine:
            return pipe
        if held & mine:
            warnings.warn("an optimizer holds parameters of a DistributedPipe and others: its "
                          "state_dict() keeps torch's per-optimizer indices, which "
                          "torch.distributed.checkpoint merges across ranks; give the pipe's "
                          "parameters an optimizer of their own", stacklevel=4)
    return None


def _names(optimizer: torch.optim.Optimizer, pipe: Any) -> List[List[str]]:
    """Each group's parameters under their plain-model names, in the group's order."""
    plain = pipe._checkpoint_names()
    by_id = {id(p): plain[n] for n, p in pipe.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _from_torch_helpers() -> bool:
    """Whether ``torch.distributed.checkpoint.state_dict`` is the caller (it maps the indices
    to names itself)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _TORCH_HELPERS:
            return True
        frame = frame.f_back
    return False


def _by_name(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any],
             ref: "weakref.ref[Any]") -> Optional[Dict[str, Any]]:
    """``state_dict()``'s post-hook: indices to plain names, each group's record added."""
    pipe = ref()
    if pipe is None or _from_torch_helpers():
        return None
    flat = [n for group in _names(optimizer, pipe) for n in group]
    state = {flat[i]: value for i, value in state_dict["state"].items()}
    groups = []
    for group in state_dict["param_groups"]:
        names = [flat[i] for i in group["params"]]
        lr = group.get("lr")
        if isinstance(lr, float):
            lr = RecordedLr(lr, names, [n for n in names if n in state])
        groups.append({**group, "params": names, **({"lr": lr} if "lr" in group else {})})
    return {"state": state, "param_groups": groups}


def _from_names(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any],
                ref: "weakref.ref[Any]") -> Optional[Dict[str, Any]]:
    """``load_state_dict``'s pre-hook: a state dict keyed by names (plain or this rank's) to
    this optimizer's order; one keyed by indices is left to torch."""
    pipe = ref()
    groups = state_dict.get("param_groups", [])
    if pipe is None or not all(isinstance(n, str) for g in groups for n in g["params"]):
        return None
    own = _names(optimizer, pipe)
    if len(groups) != len(own):
        raise OptimizerStateError(
            f"the optimizer state dict has {len(groups)} parameter groups, this optimizer "
            f"{len(own)}; build the optimizer with the groups of the one that saved it")
    plain = {**pipe._checkpoint_names(), **{n: n for names in own for n in names}}
    state = {plain.get(k, k): v for k, v in state_dict["state"].items()}
    mine = {n for names in own for n in names}
    foreign = sorted(str(k) for k in state if k not in mine)
    if foreign:
        raise OptimizerStateError(
            f"the optimizer state dict holds the state of parameters this rank's optimizer "
            f"does not hold, e.g. {foreign[:3]}: another rank's (or another model's) state "
            f"dict; load each rank's own, or use fastpipe.checkpoint to change layouts")
    _check_records([g.get("lr") for g in groups], own, set(state), positional=False)
    rebuilt = [{**g, "params": names} for g, names in zip(groups, own)]
    _plain_lrs(rebuilt)
    return {"state": {n: state[n] for names in own for n in names if n in state},
            "param_groups": rebuilt}


def _check_records(lrs: Sequence[Any], own: List[List[str]], held: set,
                   positional: bool) -> None:
    """What the saved groups' records say against this optimizer: under a positional load,
    the groups must be this rank's; every parameter saved with state must have state now."""
    records = [lr if isinstance(lr, RecordedLr) else None for lr in lrs]
    if not any(records):
        return
    for record, names in zip(records, own):
        if positional and record is not None and record.names != names:
            raise OptimizerStateError(
                f"this optimizer was loaded with the parameter groups of parameters "
                f"{record.names[:3]}..., but it holds {names[:3]}...: another rank's state "
                f"dict (torch.distributed.checkpoint keeps one copy of what all ranks save "
                f"under one key). Save and load with fastpipe.checkpoint, or with "
                f"torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict")
    lost = [n for record, names in zip(records, own)
            if record is not None and record.names == names
            for n in record.stateful if n not in held]
    mine = [n for names in own for n in names]
    if not lost and any(r.stateful for r in records if r is not None) and not held & set(mine):
        lost = mine  # another rank's groups were read, and no state at all
    if lost:
        raise OptimizerStateError(
            f"the optimizer state was saved for {lost[:3]}, but the state dict loaded into "
            f"this optimizer had none for them (torch.distributed.checkpoint loads in place: "
            f"the state_dict() of an optimizer that never stepped has no state, so none is "
            f"read). Load with fastpipe.checkpoint.load, or with "
            f"torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict")


def _plain_lrs(groups: Sequence[Dict[str, Any]]) -> None:
    for group in groups:
        if isinstance(group.get("lr"), RecordedLr):
            group["lr"] = float(group["lr"])
