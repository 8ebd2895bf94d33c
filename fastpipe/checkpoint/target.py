"""What a save or load is about: the checked arguments, and the layout random numbers need.

A ``Target`` names the optimizer's parameters by the plain model's names (``pipe._checkpoint_
names()``: a weight tied across ranks by its first name), so every rank and the plain model key
one parameter alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..distributed import DistributedPipe
from ..frontdoor import FrontDoor
from ..pipe import Pipe


@dataclass
class Target:
    """The checked arguments of a save or load: the model and what belongs to it."""

    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Optional[Any]
    groups: List[List[str]]  # the optimizer's parameters by group, under plain names
    params: Dict[str, nn.Parameter]  # plain name -> this process's parameter

    @property
    def names(self) -> List[str]:
        return [n for group in self.groups for n in group]


def target(model: Any, optimizer: Any, scheduler: Any) -> Target:
    """The arguments checked (a typed error naming the argument and the fix), nothing read."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pipe must be a fastpipe pipe or an nn.Module, got "
                        f"{type(model).__name__}")
    plain = model._checkpoint_names() if isinstance(model, FrontDoor) else None
    params: Dict[str, nn.Parameter] = {}
    by_id: Dict[int, str] = {}
    for name, param in model.named_parameters():
        name = plain[name] if plain is not None else name
        params[name], by_id[id(param)] = param, name
    groups: List[List[str]] = []
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None), got "
                            f"{type(optimizer).__name__}")
        foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]
                   if id(p) not in by_id]
        if foreign:
            raise ValueError(f"optimizer holds {len(foreign)} parameters that are not the "
                             f"pipe's (shapes {foreign[:3]}): build it over pipe.parameters() "
                             f"of this pipe, in this process")
        groups = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if scheduler is not None:
        if not (callable(getattr(scheduler, "state_dict", None))
                and callable(getattr(scheduler, "load_state_dict", None))):
            raise TypeError(f"scheduler must have state_dict() and load_state_dict() (a "
                            f"torch.optim.lr_scheduler.LRScheduler), got "
                            f"{type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler steps another optimizer than the optimizer given; "
                             "pass the optimizer the scheduler was built on")
    return Target(model, optimizer, scheduler, groups, params)


def layout(model: nn.Module) -> Dict[str, Any]:
    """What must equal between a save and a load for random numbers to continue exactly."""
    if isinstance(model, DistributedPipe):
        return {"kind": "DistributedPipe", **_common(model),
                "world": torch.distributed.get_world_size(),
                "mesh": dict(model.mesh.shape) if model.mesh is not None else None,
                "replicas": model._driver.replicas}
    if isinstance(model, Pipe):
        return {"kind": "Pipe", **_common(model), "devices": [str(d) for d in model.devices]}
    return {"kind": "module", "class": type(model).__qualname__}


def _common(pipe: FrontDoor) -> Dict[str, Any]:
    return {"stages": pipe.num_stages, "balance": list(pipe.balance),
            "virtual_stages": pipe.virtual_stages, "schedule": pipe.layout.schedule,
            "chunks": "auto" if pipe.layout.auto_chunks else pipe.layout.chunks}
