"""A ``DistributedPipe`` rank's optimizer: a load that lost this rank's parameter groups is
refused, before the optimizer changes.

``torch.distributed.checkpoint`` keeps one copy of what several ranks save under the same key.
The optimizer's ``param_groups`` travel under positional keys (``optim.param_groups.0.lr``, ...)
both in torch's ``get_state_dict(model, optimizer)`` with its default options (the optimizer
state nested) and in a rank's own ``optimizer.state_dict()``: the same keys on every rank, so a
checkpoint holds one rank's groups. ``set_state_dict`` then maps the groups to this rank's
parameters by name, finds none of its own, and hands the optimizer groups without any
hyperparameter (the next ``step()`` fails with ``KeyError: 'betas'``). Keys that differ per
parameter are what work: ``fastpipe.checkpoint``, or ``get_state_dict`` / ``set_state_dict``
with ``StateDictOptions(flatten_optimizer_state_dict=True)``.

fastpipe cannot make the nested route work without changing what ``optimizer.state_dict()``
returns (the information is lost when the checkpoint is written), so it refuses the load
where it sees the optimizer, and changes nothing else: on an optimizer it was handed
(``train_step(optimizer=...)``, ``fastpipe.checkpoint.save`` / ``load``), a
``load_state_dict`` pre-hook refuses a state dict whose groups carry none of the
optimizer's hyperparameters (inside ``set_state_dict`` the optimizer loads first, so neither
it nor the model has changed), and ``train_step`` refuses an optimizer whose groups already
lack a hyperparameter its defaults give every group (a load that happened before fastpipe saw
the optimizer), before the step runs. Both raise :class:`OptimizerStateError`. The hook checks
what is loaded, not who loads it, and ``optimizer.state_dict()`` is torch's own.

What it cannot see: an optimizer it was never handed (torch's ``KeyError`` then), and a rank's
own ``optimizer.state_dict()`` saved through ``torch.distributed.checkpoint``: its state is
keyed by per-optimizer indices, the same on every rank, so the checkpoint keeps one rank's
state under each index; ``torch.distributed.checkpoint`` refuses the load when the ranks'
states have other shapes, and nothing can tell when they have the same.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List

import torch

_watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_ROUTES = ("save and load a DistributedPipe's optimizer with fastpipe.checkpoint.save / load, "
           "or with torch's get_state_dict / set_state_dict(..., options=StateDictOptions("
           "flatten_optimizer_state_dict=True))")
_NOT_HYPER = ("params", "param_names")
_CAUSE = ("torch.distributed.checkpoint keeps one rank's param_groups, which torch's "
          "get_state_dict with its default options saves under the same keys on every rank")


class OptimizerStateError(ValueError):
    """An optimizer state that is not this rank's (another rank's parameter groups, or groups
    without their hyperparameters); raised before the optimizer changes."""


def watch(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, from now on, loads into ``optimizer`` that lost its parameter groups (once per
    optimizer; what ``state_dict()`` returns is unchanged)."""
    if optimizer not in _watched:
        optimizer.register_load_state_dict_pre_hook(_check_load)
        _watched.add(optimizer)


def check_groups(optimizer: torch.optim.Optimizer) -> None:
    """Raise when a group of ``optimizer`` lacks a hyperparameter of its defaults (torch gives
    every group each of them: a load replaced the group with one that had lost them)."""
    for i, group in enumerate(optimizer.param_groups):
        missing = [k for k in optimizer.defaults if k not in group]
        if missing:
            raise OptimizerStateError(
                f"parameter group {i} of the optimizer has no {', '.join(map(repr, missing))}: "
                f"it was loaded from a state dict that held another rank's parameter groups "
                f"({_CAUSE}); {_ROUTES}")



def _check_load(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """``load_state_dict``'s pre-hook: refuse groups that carry none of the live groups'
    hyperparameters."""
    groups: List[Dict[str, Any]] = list(state_dict.get("param_groups", []))
    for i, (loaded, live) in enumerate(zip(groups, optimizer.param_groups)):
        hyper = [k for k in live if k not in _NOT_HYPER]
        if hyper and not any(k in loaded for k in hyper):
            raise OptimizerStateError(
                f"the state dict loaded into this rank's optimizer gives parameter group {i} "
                f"none of its hyperparameters ({', '.join(hyper[:4])}, ...): this rank's "
                f"groups were lost ({_CAUSE}); nothing was loaded. To resume, {_ROUTES}")
