"""Tied weights: one parameter used by layers in several stages (an embedding and the LM head).

The plain model ties weights by sharing one ``nn.Parameter`` between layers, and a ``Pipe`` keeps
that sharing, so ``parameters()`` lists the parameter once and one optimizer update serves every
use. ``Pipe(tied=[...])`` ties parameters the module holds separately, the same way.

Stages on the parameter's device (its *home*, the device of the first stage that uses it) use the
very Parameter: autograd adds the gradients of every use into its ``.grad``. A stage on another
device runs its layers with a differentiable copy, ``param.to(device)``, made at each forward
(``torch.func.functional_call``): the copy's gradient flows back into the one parameter through
autograd, so the gradients are summed before any optimizer step and the copies can never drift.
The cost is one transfer of the weight per forward and, like an activation, one copy kept per
micro-batch in flight on that stage.

A front door whose stages live in different processes cannot share a Parameter: it must keep a
copy per process, all-reduce the copies' gradients over the processes in ``TiedWeight.stages``
after the backward, and step every copy identically (or broadcast from the home stage).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Ref = Union[str, nn.Parameter]
"""A parameter named as in the plain module (``'0.weight'``) or the Parameter itself."""


@dataclass(frozen=True)
class TiedWeight:
    """One parameter used in several stages: its names in the plain module, and the stages
    (model-order indices) whose layers use it; the first one is its home."""

    names: Tuple[str, ...]
    parameter: nn.Parameter
    stages: Tuple[int, ...]


def check(module: nn.Module, tied: Sequence[Sequence[Ref]]) -> List[List[str]]:
    """The groups of ``tied`` as parameter names; ``ValueError`` / ``TypeError`` for a name that
    is not the module's, a group of fewer than two, a parameter in two groups, or parameters of
    different shapes or dtypes. Changes nothing."""
    return _resolve(module, tied)


def tie(module: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make each group (checked names) one Parameter: the first's, set on the others' layers."""
    for names in groups:
        owner, attr = _owner(module, names[0])
        first = getattr(owner, attr)
        for name in names[1:]:
            holder, attr = _owner(module, name)
            setattr(holder, attr, first)


def find(module: nn.Sequential, balance: Sequence[int]) -> List[TiedWeight]:
    """The parameters that layers of more than one stage share (``balance``: layers per stage)."""
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    stage_of_layer = {name: stage_of[i] for i, name in enumerate(module._modules)}  # any names
    names: Dict[int, List[str]] = {}
    params: Dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    found = []
    for key, shared in names.items():
        stages = sorted({stage_of_layer[n.split(".", 1)[0]] for n in shared})
        if len(stages) > 1:
            found.append(TiedWeight(tuple(shared), params[key], tuple(stages)))
    return found


def bind(stages: Sequence[Any], tied: Sequence[TiedWeight]) -> "TiedGradients":
    """Place each tied parameter on its home stage's device; let every stage that uses one run
    its layers through taps (and, on another device, a differentiable copy), wrapping the
    stage's ``call``. Returns the gradient buffers the front door sums after each step."""
    uses: Dict[int, Dict[str, nn.Parameter]] = {}
    for weight in tied:
        home = stages[weight.stages[0]].device
        with torch.no_grad():
            weight.parameter.data = weight.parameter.data.to(home)
            if weight.parameter.grad is not None:
                weight.parameter.grad = weight.parameter.grad.to(home)
        for s in weight.stages:
            local = _local_names(stages[s].module, weight.parameter)
            uses.setdefault(s, {}).update({name: weight.parameter for name in local})
    sums = TiedGradients(tied)
    for s, params in uses.items():
        stages[s].call = WithCopies(stages[s].module, params, stages[s].device, sums, s)
    return sums


class _Sum:
    """One stage's share of a tied parameter's gradient in one step."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None

    def add(self, grad: torch.Tensor) -> None:
        self.value = grad.clone() if self.value is None else self.value.add_(grad)


class _Tap(torch.autograd.Function):
    """Identity on a tied parameter whose backward adds the gradient to one stage's buffer
    instead of the parameter's ``.grad``, so each stage sums its own share in its own order."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, total: _Sum) -> torch.Tensor:  # type: ignore
        ctx.total = total
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None]:  # type: ignore[override]
        ctx.total.add(grad)
        return None, None


class TiedGradients:
    """The gradient buffers of tied parameters, per stage, during a training step.

    Stages run on their own threads, so letting autograd add every stage's gradient straight
    into one ``.grad`` would sum them in thread order (runs with one seed could differ in the
    last bit). During a step each stage sums its share in its buffer; ``flush`` adds the
    shares to ``.grad`` in stage order, so the result is the same on every run.
    """

    def __init__(self, tied: Sequence[TiedWeight]) -> None:
        self.tied = list(tied)
        self.active = False
        self.sums: Dict[Tuple[int, int], _Sum] = {}

    def begin(self, active: bool) -> None:
        """Start a step; ``active``: buffer the gradients (a training step whose ``.grad`` is
        read only after it ends), else let autograd add into ``.grad`` directly."""
        self.active = active and bool(self.tied)
        self.sums = {}

    def total(self, stage: int, param: nn.Parameter) -> _Sum:
        return self.sums.setdefault((stage, id(param)), _Sum())

    def flush(self) -> None:
        """Add each stage's share to its parameter's ``.grad``, in stage order."""
        if self.active:
            with torch.no_grad():
                for weight in self.tied:
                    for s in weight.stages:
                        share = self.sums.get((s, id(weight.parameter)))
                        if share is not None and share.value is not None:
                            _accumulate(weight.parameter, share.value)
        self.active, self.sums = False, {}


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(param.device)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class WithCopies:
    """Calls a stage's module with its tied parameters replaced: on another device by copies
    made from the one parameter at each call (so gradients flow back into it), and during a
    training step through taps that sum the stage's share of the gradient (``TiedGradients``)."""

    def __init__(self, module: nn.Module, params: Dict[str, nn.Parameter],
                 device: torch.device, sums: Optional[TiedGradients] = None,
                 stage: int = 0) -> None:
        self.module = module
        self.params = params
        self.device = device
        self.sums = sums
        self.stage = stage
        self.own = all(_get(module, name) is p for name, p in params.items())

    def __call__(self, inputs: Any) -> Any:
        sums = self.sums
        tapped = sums is not None and sums.active and torch.is_grad_enabled()
        if not tapped and self.own and all(p.device == self.device
                                           for p in self.params.values()):
            return self.module(inputs)  # the module's own parameters, where they are
        made: Dict[int, torch.Tensor] = {}  # one copy per parameter, whatever its names
        for p in self.params.values():
            if id(p) not in made:
                made[id(p)] = (_Tap.apply(p, sums.total(self.stage, p)) if tapped
                               else p).to(self.device)
        copies = {name: made[id(p)] for name, p in self.params.items()}
        return torch.func.functional_call(self.module, copies, (inputs,), strict=False)


def _get(module: nn.Module, name: str) -> Optional[nn.Parameter]:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def _local_names(module: nn.Module, param: nn.Parameter) -> List[str]:
    return [n for n, p in module.named_parameters(remove_duplicate=False) if p is param]


def _resolve(module: nn.Module, tied: Sequence[Sequence[Ref]]) -> List[List[str]]:
    """The groups of ``tied`` as parameter names, checked."""
    if isinstance(tied, (str, nn.Parameter)) or not isinstance(tied, (list, tuple)):
        raise TypeError(f"tied must be a list of groups, e.g. [('0.weight', '5.weight')], "
                        f"got {tied!r}")
    named = dict(module.named_parameters(remove_duplicate=False))
    seen: Dict[str, int] = {}
    groups = []
    for g, group in enumerate(tied):
        if isinstance(group, (str, nn.Parameter)) or not isinstance(group, (list, tuple)) \
                or len(group) < 2:
            raise ValueError(f"tied[{g}] must list at least two parameters to tie, "
                             f"e.g. ('0.weight', '5.weight'), got {group!r}")
        names = [_name_of(module, named, ref, g) for ref in group]
        for name in names:
            if name in seen:
                raise ValueError(f"parameter {name!r} is in tied[{seen[name]}] and tied[{g}]; "
                                 f"put all parameters tied together in one group")
            seen[name] = g
        _check_alike(named, names, g)
        groups.append(names)
    return groups


def _name_of(module: nn.Module, named: Dict[str, nn.Parameter], ref: Ref, group: int) -> str:
    if isinstance(ref, str):
        if ref not in named:
            hint = ", ".join(list(named)[:8])
            raise ValueError(f"tied[{group}] names {ref!r}, which is not a parameter of the "
                             f"module; use the plain module's names (e.g. {hint})")
        return ref
    if isinstance(ref, nn.Parameter):
        for name, param in named.items():
            if param is ref:
                return name
        raise ValueError(f"tied[{group}] holds a Parameter of shape {tuple(ref.shape)} that is "
                         f"not in the module; pass the module's own parameters or their names")
    raise TypeError(f"tied[{group}] holds {ref!r}; give parameter names (str) or Parameters")


def _check_alike(named: Dict[str, nn.Parameter], names: List[str], group: int) -> None:
    first = named[names[0]]
    for name in names[1:]:
        other = named[name]
        if other.shape != first.shape or other.dtype != first.dtype:
            raise ValueError(f"tied[{group}]: {name!r} is {other.dtype} {tuple(other.shape)} but "
                             f"{names[0]!r} is {first.dtype} {tuple(first.shape)}; only "
                             f"parameters of the same shape and dtype can be tied")


def _owner(module: nn.Module, name: str) -> Tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr

