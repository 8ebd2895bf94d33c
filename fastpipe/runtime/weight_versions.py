"""Weight versions for asynchronous PipeDream (``schedule='pipedream'``), in ``Pipe`` and
``DistributedPipe`` alike.

Semantics (PipeDream's 1F1B with weight versions, which its paper calls weight stashing, without
a flush between micro-batches):

* Every stage counts its weight *versions*: version ``v`` is its weights after ``v`` updates.
* After the backward of each micro-batch a stage applies the optimizer to its own parameters
  with that micro-batch's gradient (the gradient of its share of the batch loss, weighted as in
  the flushed schedules), then moves to the next version. Stages update independently.
* The first stage tags every micro-batch with the number of updates it has applied in the
  call when it forwards it (``StepState.tags``; in a ``DistributedPipe`` the tag travels in the
  header of the micro-batch's messages, ``wire.Header.version``, on either transport).
* The forward of micro-batch ``i`` on a stage uses the stage's latest version; with
  ``vertical_sync`` it uses instead, on every stage, its version at the call's start plus the
  tag: the version number stage 0 used, since every call that ends leaves every stage with as
  many updates as micro-batches (so a micro-batch sees one version index across the pipeline;
  after a call that stopped midway, a ``NonFiniteError``, one number of updates in the call).
* The backward of micro-batch ``i`` (its recomputation included) uses exactly the version its
  forward used: the stage keeps that version (a copy of its parameters) until the backward runs.
* Data parallelism (``DistributedPipe`` with replicas): before a stage updates with a
  micro-batch's gradient, its replicas average that gradient
  (``gradients.data_parallel.GradSync.average_now``), so every replica applies the same updates.
* A weight that several stages use (tied) has versions of its own, updated after the backward
  of each micro-batch on its first stage with the gradient summed over its stages, and used by
  every stage at the micro-batch's tag: :mod:`.tied_versions`.

Within one ``train_step`` the executors run the micro-batches of the call as one flush-less
1F1B pipeline (warm-up and cool-down at the call's edges); versions carry over from call to
call. This changes the optimisation: gradients are computed on stale weights, and one call
applies as many updates per stage as it has micro-batches.

Memory: a version is kept only while a micro-batch that used it is in flight on the stage, so a
stage keeps at most as many versions as it holds micro-batches in flight. With vertical sync a
stage also keeps the versions that micro-batches not yet forwarded there were tagged with (or
may be): up to the number of stages, on every stage. A ``DistributedPipe`` stage learns a tag
only from the micro-batch's message, so it keeps every version from the tag of the last
micro-batch it forwarded (tags only grow): one more, at times.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..errors import NonFiniteError, PipelineError
from ..placement import check_flag
from ..schedule import Action, ActionKind
from .failure.timeouts import Waiting
from .step import Handler, StepState, backward_action, forward_action
from .tied_versions import TiedWeights
from .transport.wire import HostReads

Slot = Tuple[nn.Module, str, nn.Parameter]  # the module holding a parameter, its name, the live one
Keep = Callable[[int], bool]  # whether a version must stay kept for forwards still to come


class StageVersions:
    """The weight versions of one stage: the live parameters, kept copies, and their users."""

    def __init__(self, module: nn.Module, tied: Set[int] = frozenset()) -> None:
        named = [(f"{prefix}.{name}" if prefix else name, (owner, name, p))
                 for prefix, owner in module.named_modules()
                 for name, p in owner._parameters.items()
                 if p is not None and p.requires_grad and id(p) not in tied]
        self.slots: List[Slot] = [slot for _, slot in named]
        self.names: List[str] = [qualified for qualified, _ in named]  # the stage module's
        self.version = 0
        self.snapshots: Dict[int, List[nn.Parameter]] = {}
        self.users: Dict[int, int] = {}  # version -> micro-batches in flight that use it
        self.used: Dict[int, int] = {}  # micro-batch -> version its forward used (this call)
        self.forwarded: Set[int] = set()  # micro-batches forwarded in this call
        self.start = 0  # the version when the call began
        self.last_tag = 0  # the tag of the last micro-batch forwarded in this call (0 first)
        self.peak = 0  # most versions kept at once

    @property
    def parameters(self) -> List[nn.Parameter]:
        return [p for _, _, p in self.slots]

    def begin_call(self) -> None:
        """A ``train_step`` call begins: nothing is in flight."""
        self.forwarded, self.snapshots, self.last_tag = set(), {}, 0
        self.start = self.version

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

    def begin(self, mb: int, version: int, tag: Optional[int]) -> None:
        self.used[mb] = version
        self.users[version] = self.users.get(version, 0) + 1
        self.forwarded.add(mb)
        if tag is not None:
            self.last_tag = tag

    def gradients(self, mb: int) -> List[torch.Tensor]:
        """Micro-batch ``mb``'s gradients of the stage's parameters (after its backward)."""
        return [c.grad for c in self.snapshots[self.used[mb]] if c.grad is not None]

    def update(self, mb: int, optimizer: Optional[torch.optim.Optimizer], keep: Keep,
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


@dataclass
class _Call:
    """What the handlers of one ``train_step`` call step and check with."""

    views: Dict[int, Optional[torch.optim.Optimizer]]  # each stage's view of the optimizer
    checks: bool  # nonfinite='raise': look at each micro-batch's gradients before updating


class PipeDream:
    """The per-stage versions of a pipe and the F/B handlers that keep and update them.

    ``stages``: the pipe's (another process's stand in without a module). A
    ``DistributedPipe`` also gives ``replicas`` (a ``gradients.data_parallel.GradSync``: the
    stage's data-parallel replicas) and ``across`` (a ``gradients.tied.TiedSync``: the weights
    tied across its ranks)."""

    def __init__(self, stages: Sequence[Any], vertical_sync: bool = False, *,
                 replicas: Optional[Any] = None, across: Optional[Any] = None) -> None:
        local = [stage for stage in stages if getattr(stage, "module", None) is not None]
        self.replicas = replicas
        self.ties = TiedWeights(local, across, self._floor)
        # the stages this process holds (all of them in a Pipe, its own in a DistributedPipe)
        self.versions: Dict[int, StageVersions] = {
            stage.index: StageVersions(stage.module, self.ties.ids()) for stage in local}
        self.vertical_sync = vertical_sync
        self._call = _Call({}, False)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter the optimizer steps must belong to exactly one stage (or be a tied
        weight), and its state must be per parameter (each stage steps a view of it on its own
        thread)."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise NotImplementedError("schedule='pipedream' steps each stage's parameters on "
                                      "their own; LBFGS keeps one state for all of them: use an "
                                      "optimizer with per-parameter state (SGD, Adam, ...)")
        owners: Dict[int, str] = {i: "a tied weight" for i in self.ties.ids()}
        for s, versions in self.versions.items():
            for p in versions.parameters:
                if id(p) in owners:
                    raise RuntimeError(f"a parameter of stage {s} is also {owners[id(p)]}; this "
                                       f"is a bug in weight versioning")
                owners[id(p)] = f"stage {s}"
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
        checks = nonfinite == "raise"
        self._call = _Call({s: stage_optimizer(optimizer, v.parameters)
                            for s, v in self.versions.items()}, checks)
        for versions in self.versions.values():  # nothing is in flight between calls
            versions.begin_call()
        self.ties.begin_call(lambda params: stage_optimizer(optimizer, params),
                             _check_finite if checks else None)
        return {ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward}

    def _forward(self, step: StepState, stage: Any, action: Action) -> None:
        versions, mb = self.versions[stage.index], action.microbatch
        version = self._forward_version(step, stage.index, mb)
        tied = self.ties.of(stage.index)
        tag = (self._tag(step, stage.index, mb) if tied or self.vertical_sync
               else step.tags.get(mb))
        self.ties.begin(step, stage.index, action, tag)  # before versions.begin: see _floor
        versions.begin(mb, version, tag)
        with versions.using(version), self.ties.using(stage.index, mb):
            forward_action(step, stage, action)

    def _backward(self, step: StepState, stage: Any, action: Action) -> None:
        versions, mb = self.versions[stage.index], action.microbatch
        with versions.using(versions.used[mb]), self.ties.using(stage.index, mb):
            backward_action(step, stage, action)
        self._average(stage.index, action, versions)
        check = None
        if self._call.checks:
            def check(copies: List[nn.Parameter]) -> None:
                _check_finite(stage.index, mb, list(zip(versions.names,
                                                        (c.grad for c in copies))), step.reads)
        versions.update(mb, self._call.views[stage.index], self._keeper(step, stage.index),
                        check)
        self.ties.after_backward(step, stage.index, action)

    def finish(self, step: StepState, num_microbatches: int) -> None:
        """After this rank's program (``DistributedPipe``): the tied weights' last sums."""
        self.ties.finish(step, min(self.versions), num_microbatches)

    # ---------------------------------------------------------------- versions and tags
    def _forward_version(self, step: StepState, stage: int, mb: int) -> int:
        if stage == 0:  # the tag the micro-batch carries: stage 0's updates in this call
            step.tags[mb] = self.versions[0].version - self.versions[0].start
        if not self.vertical_sync:
            return self.versions[stage].version
        return self.versions[stage].start + self._tag(step, stage, mb)

    @staticmethod
    def _tag(step: StepState, stage: int, mb: int) -> int:
        tag = step.tags.get(mb)
        if tag is None:
            raise PipelineError(f"stage {stage} forwards micro-batch {mb} without the weight "
                                f"version the first stage tagged it with (its message carries "
                                f"it): do all ranks run schedule='pipedream' with the same "
                                f"fastpipe?")
        return tag

    def _floor(self, step: StepState, stage: int) -> int:
        """The lowest tag a forward still to come on ``stage`` in this call may carry."""
        if 0 in self.versions:  # the first stage is here: it tags with its updates (they grow)
            first = self.versions[0]
            low = first.version - first.start  # read first: later tags are at least this
            waiting = [t for mb, t in list(step.tags.items())
                       if mb not in self.versions[stage].forwarded]
            return min([low, *waiting])
        return self.versions[stage].last_tag  # tags grow with the micro-batch

    def _keeper(self, step: StepState, stage: int) -> Keep:
        """Which versions a stage must keep for forwards still to come (vertical sync only)."""
        if not self.vertical_sync or stage == 0:
            return lambda version: False
        start = self.versions[stage].start
        return lambda version: version >= start + self._floor(step, stage)

    def _average(self, stage: int, action: Action, versions: StageVersions) -> None:
        """Average micro-batch ``mb``'s gradients over the stage's data-parallel replicas, the
        stage's shares of tied weights included (every replica holds the same ones)."""
        if self.replicas is None:
            return
        mb = action.microbatch
        what = f"the data-parallel average of stage {stage}'s gradient of micro-batch {mb}"
        self.replicas.average_now(
            versions.gradients(mb) + self.ties.shares(stage, mb),
            Waiting(what, self.replicas.timeout, rank=self.replicas.board.rank, stage=stage,
                    action=action))


def _check_finite(stage: int, mb: int, named: Sequence[Tuple[str, Optional[torch.Tensor]]],
                  reads: HostReads) -> None:
    """Raise ``NonFiniteError`` if a gradient of micro-batch ``mb`` on ``stage`` is inf or
    NaN (before the stage updates with it): every gradient's flag computed on the device, all
    read on the host at once (one read per update, counted in ``reads``)."""
    named = [(name, grad) for name, grad in named if grad is not None]
    if not named:
        return
    flags = [torch.isfinite(g).all() for _, g in named]
    # a DTensor's flag over all its shards (a collective, on the device), alike on every rank
    flags = [getattr(f, "full_tensor", lambda f=f: f)() for f in flags]
    finite = reads.read(torch.stack([f.to(flags[0].device) for f in flags]))
    for (name, _), ok in zip(named, finite.tolist()):
        if not ok:
            raise NonFiniteError(
                f"non-finite gradient of {name!r} on stage {stage} for micro-batch {mb}; the "
                f"stage did not update with it (schedule='pipedream' applies each micro-batch's "
                f"update as it comes, so earlier ones stay)", stage=stage, microbatch=mb,
                parameter=name)


def check_vertical_sync(vertical_sync: Any, schedule: str, schedule_name: Any) -> bool:
    """``vertical_sync``, checked: it applies to PipeDream's weight versions only
    (``schedule``: the first schedule the pipe runs; ``schedule_name``: as the caller gave it)."""
    if check_flag(vertical_sync, "vertical_sync") and schedule != "pipedream":
        raise ValueError(f"vertical_sync=True applies to schedule='pipedream' only, got "
                         f"schedule={schedule_name!r}")
    return bool(vertical_sync)


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


def check_cuda_graphs(cuda_graphs: bool, schedule: str) -> None:
    """``cuda_graphs=True`` with ``schedule='pipedream'`` is refused: a graph computes with the
    parameters it was captured with, at their fixed addresses, so it would ignore the weight
    version a micro-batch must use, and its weight gradients would reach the live parameters
    rather than that version, whose update then replaces them."""
    if cuda_graphs and schedule == "pipedream":
        raise NotImplementedError(
            "schedule='pipedream' with cuda_graphs=True is not supported: a CUDA graph reads the "
            "parameters it was captured with, not the weight version each micro-batch must use; "
            "pass cuda_graphs=False with schedule='pipedream', or use a flushed schedule such as "
            "'1f1b' with cuda_graphs=True")


def step_optimizer(optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """The update after a flushed step: ``optimizer.step()``, or through the loss scaler."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
