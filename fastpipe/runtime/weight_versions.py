"""Weight versions for asynchronous PipeDream (``Pipe(schedule='pipedream')``).

Semantics (PipeDream's 1F1B with weight versions, which its paper calls weight stashing, without
a flush between micro-batches):

* Every stage counts its weight *versions*: version ``v`` is its weights after ``v`` updates.
* After the backward of each micro-batch a stage applies the optimizer to its own parameters
  with that micro-batch's gradient (the gradient of its share of the batch loss, weighted as in
  the flushed schedules), then moves to the next version. Stages update independently.
* The forward of micro-batch ``i`` on a stage uses the stage's latest version; with
  ``vertical_sync`` it uses instead, on every stage, the version number that stage 0 had when
  it ran that forward (so a micro-batch sees one version index across the pipeline).
* The backward of micro-batch ``i`` (its recomputation included) uses exactly the version its
  forward used: the stage keeps that version (a copy of its parameters) until the backward runs.

Within one ``train_step`` the local executor runs the micro-batches of the call as one
flush-less 1F1B pipeline (warm-up and cool-down at the call's edges); versions carry over from
call to call. This changes the optimisation: gradients are computed on stale weights, and one
call applies as many updates per stage as it has micro-batches.

Memory: a version is kept only while a micro-batch that used it is in flight on the stage, so a
stage keeps at most as many versions as it holds micro-batches in flight. With vertical sync a
stage also keeps the versions that micro-batches not yet forwarded there were tagged with (or
may be): up to the number of stages, on every stage.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..errors import NonFiniteError
from ..schedule import Action, ActionKind
from .step import Handler, StepState, backward_action, forward_action

Slot = Tuple[nn.Module, str, nn.Parameter]  # the module holding a parameter, its name, the live one


class StageVersions:
    """The weight versions of one stage: the live parameters, kept copies, and their users."""

    def __init__(self, module: nn.Module) -> None:
        named = [(f"{prefix}.{name}" if prefix else name, (owner, name, p))
                 for prefix, owner in module.named_modules()
                 for name, p in owner._parameters.items() if p is not None and p.requires_grad]
        self.slots: List[Slot] = [slot for _, slot in named]
        self.names: List[str] = [qualified for qualified, _ in named]  # the plain model's
        self.version = 0
        self.snapshots: Dict[int, List[nn.Parameter]] = {}
        self.users: Dict[int, int] = {}  # version -> micro-batches in flight that use it
        self.used: Dict[int, int] = {}  # micro-batch -> version its forward used (this call)
        self.forwarded: Set[int] = set()  # micro-batches forwarded in this call
        self.peak = 0  # most versions kept at once

    @property
    def parameters(self) -> List[nn.Parameter]:
        return [p for _, _, p in self.slots]

    def snapshot(self, version: int) -> List[nn.Parameter]:
        """The copy of ``version`` (made now when it is the live one)."""
        if version not in self.snapshots:
            if version != self.version:
                raise RuntimeError(f"weight version {version} was not kept (the stage is at "
                                   f"version {self.version}); this is a bug in weight versioning")
            self.snapshots[version] = [nn.Parameter(p.detach().clone()) for p in self.parameters]
            self.peak = max(self.peak, len(self.snapshots))
        return self.snapshots[version]

    @contextlib.contextmanager
    def using(self, version: int) -> Iterator[None]:
        """Run the stage's layers with ``version`` in place of the live parameters."""
        copies = self.snapshot(version)
        for (owner, name, _), copy in zip(self.slots, copies):
            owner._parameters[name] = copy
        try:
            yield
        finally:
            for owner, name, live in self.slots:
                owner._parameters[name] = live

    def begin(self, mb: int, version: int) -> None:
        self.used[mb] = version
        self.users[version] = self.users.get(version, 0) + 1
        self.forwarded.add(mb)

    def update(self, mb: int, optimizer: Optional[torch.optim.Optimizer],
               keep: Callable[[int], bool],
               check: Optional[Callable[[List[nn.Parameter]], None]] = None) -> None:
        """After micro-batch ``mb``'s backward: step the live parameters with its gradient
        (``check`` looks at the gradients first and may raise, leaving the weights as they
        were)."""
        version = self.used.pop(mb)
        if check is not None:
            check(self.snapshots[version])
        for live, copy in zip(self.parameters, self.snapshots[version]):
            live.grad, copy.grad = copy.grad, None
        if keep(self.version):
            self.snapshot(self.version)  # a later forward (vertical sync) needs it
        if optimizer is not None:
            optimizer.step()
        self.version += 1
        self.users[version] -= 1
        for v in list(self.snapshots):
            if not self.users.get(v) and not keep(v):
                del self.snapshots[v]


def stage_optimizer(optimizer: torch.optim.Optimizer,
                    params: Sequence[nn.Parameter]) -> Optional[torch.optim.Optimizer]:
    """A view of ``optimizer`` stepping only ``params``: same class, hyper-parameters and state
    (shared), so each stage updates its own parameters on its own thread."""
    mine = {id(p) for p in params}
    groups = [dict(g, params=[p for p in g["params"] if id(p) in mine])
              for g in optimizer.param_groups]
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = groups
    return view


class PipeDream:
    """The per-stage versions of a pipe and the F/B handlers that keep and update them."""

    def __init__(self, stages: Sequence[Any], vertical_sync: bool = False) -> None:
        # the stages this process holds (all of them in a Pipe, its own in a DistributedPipe)
        self.versions: Dict[int, StageVersions] = {
            stage.index: StageVersions(stage.module) for stage in stages
            if getattr(stage, "module", None) is not None}
        self.vertical_sync = vertical_sync
        self.tags: Dict[int, int] = {}  # micro-batch -> stage 0's version at its forward

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter the optimizer steps must belong to exactly one stage, and its state
        must be per parameter (each stage steps a view of it on its own thread)."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise NotImplementedError("schedule='pipedream' steps each stage's parameters on "
                                      "their own; LBFGS keeps one state for all of them: use an "
                                      "optimizer with per-parameter state (SGD, Adam, ...)")
        owners: Dict[int, int] = {}
        for s, versions in self.versions.items():
            for p in versions.parameters:
                if id(p) in owners:
                    raise NotImplementedError(
                        "schedule='pipedream' with a parameter shared by stages "
                        f"{owners[id(p)]} and {s} (tied weights) is not supported; untie it or "
                        "use a flushed schedule such as '1f1b'")
                owners[id(p)] = s
        for group in optimizer.param_groups:
            if any(id(p) not in owners for p in group["params"]):
                raise ValueError("optimizer holds parameters that are not the pipe's; build it "
                                 "from pipe.parameters() for schedule='pipedream'")

    def handlers(self, optimizer: torch.optim.Optimizer,
                 nonfinite: str = "ignore") -> Dict[ActionKind, Handler]:
        """The F and B handlers of one ``train_step`` call. ``nonfinite='raise'``: each stage
        checks a micro-batch's gradients before it updates with them, and raises
        ``fastpipe.NonFiniteError`` (the updates of earlier micro-batches stay: PipeDream
        applies each as it comes)."""
        self.check_optimizer(optimizer)
        views = {s: stage_optimizer(optimizer, v.parameters) for s, v in self.versions.items()}
        self.tags = {}
        for versions in self.versions.values():  # nothing is in flight between calls
            versions.forwarded, versions.snapshots = set(), {}

        def forward(step: StepState, stage: Any, action: Action) -> None:
            versions, mb = self.versions[stage.index], action.microbatch
            version = self._forward_version(stage.index, mb)
            versions.begin(mb, version)
            with versions.using(version):
                forward_action(step, stage, action)

        def backward(step: StepState, stage: Any, action: Action) -> None:
            versions, mb = self.versions[stage.index], action.microbatch
            with versions.using(versions.used[mb]):
                backward_action(step, stage, action)
            check = (functools.partial(_check_finite, stage.index, mb, versions)
                     if nonfinite == "raise" else None)
            versions.update(mb, views[stage.index], self._keeper(stage.index), check)

        return {ActionKind.FORWARD: forward, ActionKind.BACKWARD: backward}

    def _forward_version(self, stage: int, mb: int) -> int:
        if not self.vertical_sync:
            return self.versions[stage].version
        if stage == 0:
            self.tags[mb] = self.versions[0].version
        return self.tags[mb]

    def _keeper(self, stage: int) -> Callable[[int], bool]:
        """Which versions a stage must keep for forwards still to come (vertical sync only)."""
        if not self.vertical_sync or stage == 0:
            return lambda version: False

        def keep(version: int) -> bool:
            low = self.versions[0].version  # read first: later tags are at least this
            waiting = [t for mb, t in list(self.tags.items())
                       if mb not in self.versions[stage].forwarded]
            return version >= min([low, *waiting])

        return keep


def _check_finite(stage: int, mb: int, versions: StageVersions,
                  copies: Sequence[nn.Parameter]) -> None:
    """Raise ``NonFiniteError`` if a gradient of micro-batch ``mb`` on ``stage`` is inf or
    NaN (before the stage updates with it)."""
    for name, copy in zip(versions.names, copies):
        if copy.grad is not None and not bool(torch.isfinite(copy.grad).all()):
            raise NonFiniteError(
                f"non-finite gradient of {name!r} on stage {stage} for micro-batch {mb}; the "
                f"stage did not update with it (schedule='pipedream' applies each micro-batch's "
                f"update as it comes, so earlier ones stay)", stage=stage, microbatch=mb,
                parameter=name)


def check_optimizer_argument(optimizer: Any, asynchronous: bool, scaler: Any) -> None:
    """``train_step(optimizer=...)``: an optimizer or ``None``; required by PipeDream, which
    cannot take a loss scaler (its updates happen inside the step)."""
    if isinstance(optimizer, type):
        raise TypeError(f"optimizer is the class {optimizer.__module__}.{optimizer.__name__}, "
                        f"not an optimizer; pass an instance, e.g. optimizer="
                        f"{optimizer.__name__}(pipe.parameters(), lr=0.01)")
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None), got {optimizer!r}")
    if asynchronous and optimizer is None:
        raise ValueError("schedule='pipedream' updates the weights inside train_step: pass "
                         "optimizer=torch.optim.SGD(pipe.parameters(), ...) (or another one)")
    if asynchronous and scaler is not None:
        raise NotImplementedError("schedule='pipedream' with a GradScaler is not supported; "
                                  "use a flushed schedule such as '1f1b' for loss scaling")


def step_optimizer(optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """The update after a flushed step: ``optimizer.step()``, or through the loss scaler."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
