"""One plan for every front door: what the pipeline is, decided before any device work.

``plan_pipeline`` checks a front door's arguments and model, traces a module that is not an
``nn.Sequential`` (cut at its split points), balances the layers over the virtual stages, plans
the skip connections and the tied weights, places each virtual stage on a physical stage and
validates the first step's schedule: a frozen :class:`Blueprint`. It moves, ties and allocates
nothing, so a wrong argument raises with the model untouched; ``Pipe`` and ``DistributedPipe``
then realise the blueprint on their devices. What differs between them while planning is where
the stages go: :class:`OnDevices` (a ``Pipe``'s devices) or :class:`OnRanks` (a
``DistributedPipe``'s ranks).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import hf_losses, outputs, tracing
from ..placement import (auto_balance, check_balance, check_chunk_count, check_materialised,
                         check_module, default_partitions, layer_names, resolve_devices,
                         resolve_virtual_stages)
from ..policies import tied as tied_weights
from ..schedule import Schedule
from ..skip import layout as skip_layout
from .layout import Layout, first_schedule, parse_layout


@dataclass(frozen=True)
class Blueprint:
    """A pipeline as planned: everything a front door realises, nothing realised yet."""

    layout: Layout  # the checked arguments, the balance included
    module: Any  # the layers: an nn.Sequential (a traced model's stages) or layer factories
    traced: Optional[nn.Module]  # the traced model, whose names the pipe shows; else None
    stages: Tuple[Tuple[Tuple[str, Any], ...], ...]  # per virtual stage: (plain name, layer)
    skips: Mapping[int, skip_layout.StageSkips]  # where the skip connections go, per stage
    ties: Tuple[Tuple[str, ...], ...]  # groups of parameter names that become one Parameter
    physical: Tuple[Any, ...]  # the physical stages: devices (Pipe) or ranks (DistributedPipe)
    placement: Tuple[Any, ...]  # each virtual stage's physical stage
    chunks: int  # the first step's micro-batch count
    schedule: Schedule  # the first step's schedule, validated
    output_rules: outputs.OutputRules  # how the outputs combine over micro-batches

    def layers_of(self, stage: int) -> List[Any]:
        """The layers (modules, or factories) of one virtual stage, in model order."""
        return [layer for _, layer in self.stages[stage]]


class OnDevices:
    """A ``Pipe``'s stages: on ``devices`` of this process (default: the CUDA devices, or the
    CPU); the model is an ``nn.Sequential`` holding real memory, moved there."""

    follow = True  # traced stages take their mode from the traced model, the pipe's child
    traced_balance = False  # a traced model's stages are its parts: a given balance is unused

    def __init__(self, devices: Optional[Sequence[Any]]) -> None:
        self.devices = devices

    def stage_count(self, virtual_stages: int) -> int:
        """How many stages a traced model is cut into."""
        return tracing.stage_count(self.devices, virtual_stages)

    def check_traced(self, model: Any) -> None:
        """Refuse a model to trace that has no memory to place."""
        check_materialised(model)

    def layers(self, module: Any) -> List[Any]:
        """The model's layers, checked."""
        module = check_module(module)
        check_materialised(module)
        return list(module)

    def balance(self, module: Any, layers: List[Any], given: Optional[Sequence[int]],
                virtual_stages: int) -> List[int]:
        """Layers per virtual stage: ``given``, checked, else by parameter count."""
        v = virtual_stages
        if len(layers) < v:
            raise ValueError(f"virtual_stages={v} needs at least {v} layers per device but the "
                             f"module has {len(layers)}; lower virtual_stages")
        if given is None:
            stages = max(1, min(default_partitions(module, self.devices), len(layers) // v))
            given = auto_balance(module, stages * v)
        return check_balance(given, module)

    def physical(self, balance: Sequence[int], virtual_stages: int) -> Tuple[torch.device, ...]:
        """One device per physical stage."""
        count = check_chunk_count(len(balance), virtual_stages)
        return tuple(resolve_devices(self.devices, count))


class OnRanks:
    """A ``DistributedPipe``'s stages: one physical stage per rank of ``ranks`` (the pipeline's
    process group, in stage order); the model is an ``nn.Sequential`` (on the meta device if
    large) or a list of functions that each build one layer."""

    follow = False  # a rank keeps its stages apart from the traced model
    traced_balance = True  # a given balance is checked against the traced stages too

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)

    def stage_count(self, virtual_stages: int) -> int:
        """How many stages a traced model is cut into."""
        return len(self.ranks) * virtual_stages

    def check_traced(self, model: Any) -> None:
        """A rank gives memory to its own stages later: any model may be traced."""

    def layers(self, module: Any) -> List[Any]:
        """The model's layers (modules, or functions that build one), checked."""
        if isinstance(module, nn.Sequential):
            if len(module) == 0:
                raise ValueError("module is an empty nn.Sequential; give it at least one layer")
            return list(module)
        if isinstance(module, (list, tuple)) and module and all(callable(f) for f in module):
            return list(module)
        raise TypeError(f"module must be an nn.Sequential or a list of functions that each "
                        f"build one layer, got {type(module).__name__}")

    def balance(self, module: Any, layers: List[Any], given: Optional[Sequence[int]],
                virtual_stages: int) -> List[int]:
        """Layers per virtual stage: ``given``, checked, else by parameter count (by layer
        count for factories)."""
        parts = len(self.ranks) * virtual_stages
        if given is None:
            if len(layers) < parts:
                raise ValueError(f"the model has {len(layers)} layers but the pipeline needs at "
                                 f"least {parts} (ranks x virtual_stages); use fewer ranks")
            if isinstance(module, nn.Sequential):
                return auto_balance(module, parts)
            return [len(range(i, len(layers), parts)) for i in range(parts)]
        values = check_balance(given, layers)
        if len(values) != parts:
            raise ValueError(f"balance has {len(values)} entries but the pipeline has {parts} "
                             f"virtual stages (ranks x virtual_stages); give one count per stage")
        return values

    def physical(self, balance: Sequence[int], virtual_stages: int) -> Tuple[int, ...]:
        """One rank per physical stage."""
        return self.ranks


Where = Union[OnDevices, OnRanks]


def plan_pipeline(module: Any, where: Where, *, chunks: Any, schedule: Any,
                  balance: Optional[Sequence[int]], checkpoint: Any, virtual_stages: Any,
                  timeout: Any, deferred_batch_norm: Any, tied: Sequence[Sequence[Any]],
                  split_points: Any, example_inputs: Any,
                  output_reduction: Optional[Mapping[str, Any]]) -> Blueprint:
    """The checked plan of a pipeline of ``module`` with a front door's arguments (see
    ``Pipe``), its stages going ``where``; raises a typed error naming a wrong argument, the
    model untouched."""
    reductions = outputs.check_output_reduction(output_reduction)
    traced = module if tracing.wanted(module, split_points) else None
    rules = _output_rules(reductions, module, traced is not None)
    if traced is not None:  # any module: traced, cut at split_points (fastpipe.tracing)
        where.check_traced(traced)
        count = where.stage_count(resolve_virtual_stages(virtual_stages, schedule))
        module = tracing.stages_of(traced, split_points, example_inputs, count,
                                   follow=where.follow, deferred_batch_norm=deferred_batch_norm)
        balance = balance if where.traced_balance else None
    layers = where.layers(module)
    layout = parse_layout(chunks, checkpoint, schedule, virtual_stages, timeout,
                          deferred_batch_norm)
    layout = layout.with_balance(where.balance(module, layers, balance, layout.virtual_stages))
    skips = skip_layout.plan(module, layout.balance) if isinstance(module, nn.Sequential) else {}
    ties = _check_tied(module, tied)
    physical = where.physical(layout.balance, layout.virtual_stages)
    first, plan = first_schedule(layout, len(physical))  # raises for a schedule that cannot run
    return Blueprint(
        layout=layout, module=module, traced=traced,
        stages=_stages(layer_names(module, len(layers)), layers, layout.balance), skips=skips,
        ties=tuple(tuple(group) for group in ties), physical=tuple(physical),
        placement=tuple(physical[plan.stage_of(k)[0]] for k in range(len(layout.balance))),
        chunks=first, schedule=plan, output_rules=rules)


def _output_rules(given: Mapping[str, outputs.Rule], module: Any,
                  traced: bool) -> outputs.OutputRules:
    """How the outputs combine over micro-batches: the rules given (``output_reduction``,
    checked) and those known for the model (a Hugging Face model's own loss); a traced
    module's signature names its positional inputs."""
    return outputs.OutputRules(
        given, hf_losses.known_rules(module), outputs.signature_of(module) if traced else None,
        type(module).__name__ if isinstance(module, nn.Module) else "")


def _check_tied(module: Any, tied: Sequence[Sequence[Any]]) -> List[List[str]]:
    """The groups of ``tied``, checked as parameter names of the plain model."""
    if not isinstance(module, nn.Sequential):
        if tied:
            raise ValueError("tied=... needs the model as an nn.Sequential (it names the "
                             "plain model's parameters); layer factories cannot share weights")
        return []
    return tied_weights.check(module, tied)


def _stages(names: Sequence[str], layers: Sequence[Any],
            balance: Sequence[int]) -> Tuple[Tuple[Tuple[str, Any], ...], ...]:
    """Each virtual stage's (plain name, layer) pairs, ``balance[k]`` consecutive layers."""
    starts = [0, *itertools.accumulate(balance)]
    return tuple(tuple(zip(names[starts[k]:starts[k + 1]], layers[starts[k]:starts[k + 1]]))
                 for k in range(len(balance)))
