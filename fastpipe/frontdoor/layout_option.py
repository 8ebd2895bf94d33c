"""The front doors' ``layout=``: a Megatron layout string as the arguments fastpipe takes.

A module that is traced gets ``split_points``: each stage after the first begins at its first
``t`` (that block of the model's largest list of repeated blocks, the one ``split_points='auto'``
cuts) or, when it begins with ``L``, at the first submodule registered after those blocks (a
transformer's final norm). An ``nn.Sequential`` (or a ``DistributedPipe``'s list of layer
factories) gets a ``balance``: one layer per letter. Both get the virtual-stage count, the
layout's stages over the physical stages (devices of a ``Pipe``, ranks of a
``DistributedPipe``), as Megatron's virtual pipeline size is its stage count over its pipeline
size; stage ``k`` goes where the schedule puts virtual stage ``k`` (in a loop, ``k`` on physical
stage ``k mod P``, for the interleaved schedules, as Megatron's). Everything is checked before
any work, and nothing downstream knows a layout string was given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import tracing
from ..placement import resolve_devices, resolve_virtual_stages
from ..split_points import module_after, repeated_blocks
from . import layout_string
from .layout_string import ParsedLayout
from .plan import OnDevices, OnRanks, Where

__all__ = ["LayoutArguments", "resolve_layout"]


@dataclass(frozen=True)
class LayoutArguments:
    """A front door's cut arguments, with ``layout=`` (if given) turned into them."""

    split_points: Any
    balance: Optional[Sequence[int]]
    virtual_stages: Any
    where: Where  # a Pipe's devices filled in when the layout chose them


def resolve_layout(layout: Optional[str], module: Any, where: Where, *,
                   balance: Optional[Sequence[int]], split_points: Any, virtual_stages: Any,
                   schedule: Any) -> LayoutArguments:
    """The arguments as given without ``layout``; with it, the split points (a traced
    module) or the balance, the virtual-stage count and the devices it implies (a typed
    error naming the argument, or the layout's column and stage, before any work)."""
    if layout is None:
        return LayoutArguments(split_points, balance, virtual_stages, where)
    for name, value in (("balance", balance), ("split_points", split_points)):
        if value is not None:
            raise ValueError(f"layout= and {name}= both say where the stages begin; give "
                             f"one of them (layout={layout!r} already cuts the model)")
    parsed = layout_string.parse(layout)
    if tracing.wanted(module, None):
        split_points = _split_points(parsed, module)
    else:
        balance = _balance(parsed, module)
    where, per_physical = _physical(parsed, where, virtual_stages, schedule)
    return LayoutArguments(split_points, balance, per_physical, where)


def _split_points(parsed: ParsedLayout, module: nn.Module) -> List[str]:
    """A traced module's split points: where each stage after the first begins."""
    found = repeated_blocks(module)
    if found is None or not found[0]:
        raise ValueError(f"layout= needs a list of repeated blocks (an nn.ModuleList of "
                         f"same-type modules) in {type(module).__name__} for its t letters; "
                         f"give split_points=[...] by name instead")
    prefix, blocks = found
    layout_string.check_traced(parsed, len(blocks), prefix)
    layout_string.check_no_empty(parsed)
    starts = layout_string.block_starts(parsed, len(blocks))
    tail = module_after(module, prefix) if len(blocks) in starts else None
    if len(blocks) in starts and tail is None:
        loss = parsed.letters[-1]
        raise parsed.error(loss.column, loss.stage,
                           f"L begins a stage, but {type(module).__name__} has no submodule "
                           f"after {prefix} to begin it with; put L in the last t's stage")
    return [tail if i == len(blocks) else f"{prefix}.{i}" for i in starts]


def _balance(parsed: ParsedLayout, module: Any) -> List[int]:
    """An ``nn.Sequential``'s (or a list of layer factories') balance: one layer per letter."""
    if not isinstance(module, (nn.Sequential, list, tuple)):
        raise TypeError(f"layout= needs the model as an nn.Module to trace, an nn.Sequential "
                        f"or a list of layer factories, got {type(module).__name__}")
    layout_string.check_sequential(parsed, len(module))
    layout_string.check_no_empty(parsed)
    return layout_string.balance_of(parsed)


def _physical(parsed: ParsedLayout, where: Where, virtual_stages: Any,
              schedule: Any) -> Tuple[Where, int]:
    """The physical stages (a ``Pipe`` without ``devices``: one per ``virtual_stages`` of the
    layout's stages) and the virtual stages each holds, checked against ``virtual_stages``."""
    stages, per = len(parsed.stages), resolve_virtual_stages(virtual_stages, schedule)
    if isinstance(where, OnRanks):
        physical, what = len(where.ranks), "ranks"
    else:
        where = OnDevices(_devices(where.devices, stages, per))
        physical, what = len(where.devices), "devices"
    if stages % physical:
        raise ValueError(f"layout={parsed.text!r} has {stages} stages but the pipeline has "
                         f"{physical} {what}: a layout lists {what} x virtual stages stages "
                         f"(Megatron's pipeline size x virtual pipeline size)")
    found = stages // physical
    if virtual_stages is not None and found != per:
        raise ValueError(f"layout={parsed.text!r} has {stages} stages on {physical} {what}, "
                         f"{found} per {what[:-1]}, but virtual_stages={per}; drop "
                         f"virtual_stages (the layout decides it) or change the layout")
    return where, found


def _devices(devices: Any, stages: int, per: int) -> Any:
    """A ``Pipe``'s devices for a layout of ``stages`` stages: as listed, else one per
    ``per`` stages (the CUDA devices in order, or the CPU)."""
    if devices is not None:
        if isinstance(devices, (str, int, torch.device)):
            resolve_devices(devices, 1)  # raises the front door's typed error
        return list(devices)
    if stages % per:
        raise ValueError(f"the layout has {stages} stages, not a multiple of "
                         f"virtual_stages={per}; list devices=[...] or change the layout")
    count = stages // per
    if not torch.cuda.is_available():
        return ["cpu"] * count
    if count > torch.cuda.device_count():
        raise ValueError(f"the layout places {stages} stages on {count} devices ({per} each) "
                         f"but {torch.cuda.device_count()} CUDA devices are visible; list "
                         f"devices=[...] (a device may repeat) or use more virtual_stages")
    return [f"cuda:{i}" for i in range(count)]
