"""PipeDream's versions of a weight tied across stages (an embedding and the LM head).

A tied weight is one weight however many stages use it, so it has one sequence of versions,
kept apart from its stages' other weights: version ``v`` is its value after ``v`` updates, and
update ``k`` applies micro-batch ``k``'s gradient summed over every stage that uses the weight.
That sum is complete after the backward of ``k`` on the weight's first stage (its *home*:
backwards run from the last stage to the first), which applies it then.

Every use of the weight by micro-batch ``k`` (its forwards, recomputations and backwards, on
every stage) uses the version it had when the call began plus ``tag(k)``, the number of
micro-batches the pipeline's first stage had updated with in the call when it forwarded ``k``
(``StepState.tags``, the tag of vertical sync), with or without ``vertical_sync``. The schedule
itself orders those updates before every forward of ``k`` (each precedes the first stage's
forward of ``k``); whether a newer update comes before a later stage's forward depends on
timing (threads in ``Pipe``, processes in ``DistributedPipe``), so this is the newest version
every stage can use alike, whatever the timing. With the home on the first stage (an embedding
tied to the LM head) it is also the home's latest version when it forwards ``k``.

Each use (one stage, one micro-batch) runs with a leaf of its own, an alias of the version's
kept copy, so its gradient is that stage's share of that micro-batch alone, even when stages
and micro-batches use one version at once. In ``Pipe`` the home adds the shares in stage order.
In ``DistributedPipe`` each rank that uses the weight holds a copy; every rank of the pipeline
starts the sum of its share when its backward of ``k`` ends (``gradients.tied.TiedSync``: an
all-reduce, equal to the sum in stage order for a weight on two stages, and up to rounding for
more), the home waits for it and updates at once, and another copy applies the same update when
a forward first needs the version (or when the call ends): the copies go through the same
versions.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..errors import PipelineError
from ..schedule import Action
from .failure.timeouts import Waiting
from .step import StepState

Slot = Tuple[nn.Module, str]  # a module that holds the weight, and the attribute
Keep = Callable[[int], bool]  # whether a version must stay kept for forwards still to come
Floor = Callable[[StepState, int], int]  # the lowest tag a forward to come on a stage carries
Check = Callable[[int, int, Sequence[Tuple[str, Optional[torch.Tensor]]], Any], None]


class TiedVersions:
    """The versions of one tied weight in this process, and the uses that hold them."""

    def __init__(self, name: str, param: nn.Parameter, stages: Sequence[int],
                 slots: Dict[int, List[Slot]], index: Optional[int] = None) -> None:
        self.name = name
        self.param = param  # the live weight (this process's copy)
        self.stages = tuple(stages)  # every stage that uses it, in model order
        self.slots = slots  # this process's stages that use it -> where their modules hold it
        self.index = index  # its place among the pipe's tied weights across ranks, if any
        self.version = 0
        self.start = 0  # the version when the call began
        self.snapshots: Dict[int, torch.Tensor] = {}
        self.users: Dict[int, int] = {}  # version -> uses in flight
        self.uses: Dict[Tuple[int, int], Tuple[int, nn.Parameter]] = {}  # (stage, mb)
        self.pending: List[Any] = []  # sums started, not yet applied (DistributedPipe)
        self.peak = 0  # most versions kept at once
        self._lock = threading.Lock()  # Pipe: the stages' threads share it

    @property
    def home(self) -> int:
        """The first stage that uses it: its backward of a micro-batch completes the sum."""
        return self.stages[0]

    def begin_call(self) -> None:
        """A ``train_step`` call begins: nothing is in flight."""
        self.start = self.version
        self.snapshots, self.users, self.uses, self.pending = {}, {}, {}, []

    def begin(self, stage: int, mb: int, version: int) -> None:
        """Micro-batch ``mb``'s forward on ``stage`` uses ``version``: a leaf of its own."""
        with self._lock:
            if version not in self.snapshots:
                if version != self.version:
                    raise RuntimeError(f"version {version} of tied weight {self.name!r} was not "
                                       f"kept (it is at version {self.version}); this is a bug "
                                       f"in weight versioning")
                self.snapshots[version] = self.param.detach().clone()
                self.peak = max(self.peak, len(self.snapshots))
            self.users[version] = self.users.get(version, 0) + 1
            self.uses[(stage, mb)] = (version, nn.Parameter(self.snapshots[version]))

    @contextlib.contextmanager
    def using(self, stage: int, mb: int) -> Iterator[None]:
        """Run ``stage``'s layers with the leaf of micro-batch ``mb`` in place of the weight."""
        leaf = self.uses[(stage, mb)][1]
        for owner, name in self.slots[stage]:
            owner._parameters[name] = leaf
        try:
            yield
        finally:
            for owner, name in self.slots[stage]:
                owner._parameters[name] = self.param

    def share(self, stage: int, mb: int) -> Optional[torch.Tensor]:
        """``stage``'s share of micro-batch ``mb``'s gradient (after its backward)."""
        return self.uses[(stage, mb)][1].grad

    def total(self, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s gradient: every stage's share, added in stage order (a stage
        without one adds zeros). Every stage that uses the weight is in this process."""
        total: Optional[torch.Tensor] = None
        for stage in self.stages:
            share = self.share(stage, mb)
            share = torch.zeros_like(self.param) if share is None else share.detach()
            total = share.clone() if total is None else total + share
        assert total is not None
        return total

    def release(self, stage: int, mb: int, keep: Keep) -> None:
        """Micro-batch ``mb`` is done with ``stage``'s leaf."""
        with self._lock:
            version, _ = self.uses.pop((stage, mb))
            self.users[version] -= 1
            self._drop(keep)

    def update(self, grad: torch.Tensor, optimizer: Optional[torch.optim.Optimizer],
               keep: Keep) -> None:
        """Step the live weight with one micro-batch's summed gradient; keep the version it
        leaves when a forward still to come may use it."""
        with self._lock:
            if keep(self.version) and self.version not in self.snapshots:
                self.snapshots[self.version] = self.param.detach().clone()
                self.peak = max(self.peak, len(self.snapshots))
            self.param.grad = grad
            if optimizer is not None:
                optimizer.step()
            self.version += 1
            self._drop(keep)

    def _drop(self, keep: Keep) -> None:
        for v in list(self.snapshots):
            if not self.users.get(v) and not keep(v):
                del self.snapshots[v]


def shared_in_process(stages: Sequence[Any]) -> List[TiedVersions]:
    """The weights that several of ``stages`` (one process's) share as one Parameter and that
    take gradients, each with where every stage's modules hold it. ``NotImplementedError`` for
    one used on another device than its own (``fastpipe.policies.tied`` then runs those layers
    with copies made from the live weight, which a version cannot replace)."""
    users: Dict[int, List[Any]] = {}
    params: Dict[int, nn.Parameter] = {}
    for stage in stages:
        for p in {id(p): p for p in stage.module.parameters()}.values():
            users.setdefault(id(p), []).append(stage)
            params[id(p)] = p
    found = []
    for key, using in users.items():
        param = params[key]
        if len(using) < 2 or not param.requires_grad:
            continue
        name = next(n for n, p in using[0].module.named_parameters() if p is param)
        away = [s.index for s in using if s.device != param.device]
        if away:
            raise NotImplementedError(
                f"schedule='pipedream' with the weight {name!r} of stage {using[0].index} tied "
                f"to layers on stages {away} on another device is not supported: those layers "
                f"use a copy made from the live weight, not the weight version each "
                f"micro-batch must use; place the stages that share it on one device, or use a "
                f"flushed schedule such as '1f1b'")
        found.append(TiedVersions(name, param, [s.index for s in using],
                                  {s.index: slots_of(s.module, param) for s in using}))
    return found


def slots_of(module: nn.Module, param: nn.Parameter) -> List[Slot]:
    """Where ``module`` (and its submodules) hold ``param``."""
    return [(owner, name) for owner in module.modules()
            for name, p in owner._parameters.items() if p is param]


def across_ranks(local: Sequence[Any], across: Any) -> List[TiedVersions]:
    """The copies of weights tied across ranks (``gradients.tied.TiedSync``) that this rank's
    stages hold and train. ``NotImplementedError`` for one whose first stage is not the
    pipeline's first."""
    found = []
    for index in across.trained():
        shared = across.shared[index]
        if shared.stages[0] != 0:
            raise NotImplementedError(
                f"schedule='pipedream' with the weight {shared.names[0]!r} tied across ranks "
                f"from stage {shared.stages[0]} on is not supported: its copies sum each "
                f"micro-batch's gradient in a collective that every rank of the pipeline starts "
                f"when its backward of the micro-batch ends, and the ranks of stages before "
                f"{shared.stages[0]} reach that point only after the sum is needed; tie weights "
                f"that the first stage uses (an embedding and the LM head), or use a flushed "
                f"schedule such as '1f1b'")
        if shared.local is None:
            continue
        slots = {stage.index: slots_of(stage.module, shared.local) for stage in local}
        found.append(TiedVersions(shared.names[0], shared.local, shared.stages,
                                  {s: where for s, where in slots.items() if where}, index))
    return found


class TiedWeights:
    """A pipe's tied weights under PipeDream: their versions, the uses of each micro-batch,
    and their updates (in one process, or across ranks through ``across``, a
    ``gradients.tied.TiedSync``). ``floor(step, stage)``: the lowest tag a forward still to
    come on ``stage`` carries (the weight versions' rule, shared)."""

    def __init__(self, local: Sequence[Any], across: Optional[Any], floor: Floor) -> None:
        self.across = across
        self.ties: List[TiedVersions] = (across_ranks(local, across) if across is not None
                                         else shared_in_process(local))
        self.floor = floor
        self.views: Dict[int, Optional[torch.optim.Optimizer]] = {}
        self.check: Optional[Check] = None
        self.waiting: List[Any] = []  # sums this rank takes part in without a copy

    def ids(self) -> Set[int]:
        return {id(t.param) for t in self.ties}

    def of(self, stage: int) -> List[TiedVersions]:
        """The tied weights ``stage`` uses (and this process holds)."""
        return [tie for tie in self.ties if stage in tie.slots]

    def begin_call(self, view: Callable[[Sequence[nn.Parameter]], Any],
                   check: Optional[Check]) -> None:
        """A ``train_step`` call begins: ``view(params)`` is the optimizer stepping only
        ``params``; ``check`` looks at a sum before it is applied."""
        self.views = {id(t): view([t.param]) for t in self.ties}
        self.check = check
        self.waiting = []
        for tie in self.ties:
            tie.begin_call()

    def keeper(self, step: StepState, tie: TiedVersions) -> Keep:
        """The versions of ``tie`` a forward still to come may use, on any of this process's
        stages that use it."""
        return lambda version: version >= tie.start + min(self.floor(step, s)
                                                          for s in tie.slots)

    @contextlib.contextmanager
    def using(self, stage: int, mb: int) -> Iterator[None]:
        """Every tied weight of ``stage`` at micro-batch ``mb``'s version."""
        with contextlib.ExitStack() as stack:
            for tie in self.of(stage):
                stack.enter_context(tie.using(stage, mb))
            yield

    def shares(self, stage: int, mb: int) -> List[torch.Tensor]:
        """``stage``'s shares of micro-batch ``mb``'s gradients of its tied weights."""
        return [g for g in (t.share(stage, mb) for t in self.of(stage)) if g is not None]

    def begin(self, step: StepState, stage: int, action: Action, tag: Optional[int]) -> None:
        """Before ``stage``'s forward of a micro-batch tagged ``tag``: each of its tied weights
        at that version (a copy across ranks first applies the sums it lacks), with a leaf for
        this use."""
        for tie in self.of(stage):
            assert tag is not None
            self._catch_up(step, tie, tie.start + tag, stage, action)
            tie.begin(stage, action.microbatch, tie.start + tag)

    def after_backward(self, step: StepState, stage: int, action: Action) -> None:
        """After ``stage``'s backward of a micro-batch: in one process the home adds every
        stage's share and updates; across ranks every rank starts each sum, the home waits for
        it and updates, the other copies apply it when they need it."""
        mb = action.microbatch
        if self.across is None:
            for tie in self.of(stage):
                if stage == tie.home:
                    self._apply(step, tie, tie.total(mb), stage, mb)
                    for s in tie.stages:
                        tie.release(s, mb, self.keeper(step, tie))
            return
        held = {t.index: t for t in self.ties}
        for index in self.across.trained():  # every rank, every weight, in one order
            tie = held.get(index)
            share = tie.share(stage, mb) if tie is not None else None
            pending = self.across.start_sum(index, share, step.reads)
            if tie is None:
                self.waiting.append(pending)
                continue
            tie.release(stage, mb, self.keeper(step, tie))
            tie.pending.append(pending)
            if stage == tie.home:
                self._catch_up(step, tie, tie.version + 1, stage, action)

    def finish(self, step: StepState, stage: int, num_microbatches: int) -> None:
        """After this rank's program: every copy applies the sums still to come, and the sums
        this rank only took part in are waited for (bounded), so every rank ends the call at
        the same versions."""
        for tie in self.ties:
            end = tie.start + num_microbatches
            self._catch_up(step, tie, end, stage, None)
            if tie.version != end or tie.uses:
                raise PipelineError(f"tied weight {tie.name!r} ended the call at version "
                                    f"{tie.version}, not {end}: the ranks' programs and the "
                                    f"schedule disagree")
        waiting, self.waiting = self.waiting, []
        for pending in waiting:
            pending.result(self._waiting("the sums over ranks of the tied weights' gradients "
                                         "(this rank holds no copy)", stage, None),
                           torch.device("cpu"))

    def _catch_up(self, step: StepState, tie: TiedVersions, version: int, stage: int,
                  action: Optional[Action]) -> None:
        """Apply the started sums of a copy until it reaches ``version`` (across ranks; in one
        process the home's updates already came)."""
        while tie.version < version and tie.pending:
            k = tie.version - tie.start
            what = f"the sum over ranks of micro-batch {k}'s gradient of tied {tie.name!r}"
            grad = tie.pending.pop(0).result(self._waiting(what, stage, action),
                                             tie.param.device)
            self._apply(step, tie, grad, stage, k)

    def _apply(self, step: StepState, tie: TiedVersions, grad: torch.Tensor, stage: int,
               mb: int) -> None:
        if self.check is not None:
            self.check(stage, mb, [(tie.name, grad)], step.reads)
        tie.update(grad, self.views[id(tie)], self.keeper(step, tie))

    def _waiting(self, what: str, stage: int, action: Optional[Action]) -> Waiting:
        return Waiting(what, self.across.timeout, rank=self.across.board.rank, stage=stage,
                       action=action)
