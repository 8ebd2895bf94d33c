"""``generate`` through a pipeline: the decode schedule run by the pipe's own executors.

The schedule (:func:`fastpipe.schedule.decode.decode`) unrolls generation into ``steps * K``
virtual stages; every one of them is a view of one of the pipe's ``K`` stages
(:class:`Unrolled`), so the executors (worker threads of a ``Pipe``, the p2p or NCCL-group
transport of a ``DistributedPipe``) run it as any forward pass: its messages, timeouts and
failure reports are theirs. The forward handler here runs stage ``k``'s traced step on its own
cache of the group, the first stage feeds each group its next inputs from the token it gets, and
the last stage picks the tokens (:mod:`.sampling`) and sends them back along the token edge.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..runtime.dist_executor import Topology, distributed_executor
from ..runtime.transport.message import TENSOR, post, take, unflatten
from ..runtime.drivers.per_rank import RemoteStage
from ..runtime.stage import order_streams
from ..runtime.step import StepConfig, StepState
from ..schedule import Action, ActionKind, Schedule
from ..schedule.decode import decode, validate_decode
from .inputs import Feeder
from .sampling import Picker

StageFn = Any  # (carry, cache) -> (carry, cache): a split.StageStep or a SequentialStep


class Unrolled:
    """Model stage ``base`` at one iteration of generation: what the executors need of a stage
    (its index in the unrolled pipeline, device, stream and context)."""

    __slots__ = ("index", "base", "device", "stream", "skips")

    def __init__(self, index: int, base: Any) -> None:
        self.index = index
        self.base = base
        self.device = base.device
        self.stream = getattr(base, "stream", None)
        self.skips = None

    @property
    def plain(self) -> bool:
        """Whether :meth:`context` enters nothing (the base stage's answer)."""
        return bool(getattr(self.base, "plain", False))

    def context(self) -> Any:
        return self.base.context()


class SequentialStep:
    """A stage of an ``nn.Sequential`` pipe as a step without a cache: its layers (as the stage
    calls them: tied weights copied to its device) on the carry (the token ids on the first
    stage); the last stage returns the logits."""

    def __init__(self, module: Callable[[Any], Any], first: bool, last: bool) -> None:
        self.module, self.first, self.last = module, first, last

    def __call__(self, carry: Any, cache: Sequence[torch.Tensor]) -> Tuple[Any, List[Any]]:
        out = self.module(carry[0] if self.first else carry)
        if self.last:
            logits = out.logits if hasattr(out, "logits") else (
                out[0] if isinstance(out, (tuple, list)) else out)
            return (logits,), []
        return out, []


@dataclass
class Run:
    """One generation's state, shared by the handlers of this process's stages."""

    model_stages: int  # K
    first: Sequence[Optional[StageFn]]  # per model stage: the prompt's step (None: elsewhere)
    later: Sequence[Optional[StageFn]]  # the decode step (the same without a cache)
    feeders: Dict[int, Feeder]  # per group, where the first stage runs
    picker: Optional[Picker]  # where the last stage runs

    def __post_init__(self) -> None:
        self.caches: Dict[Tuple[int, int], List[torch.Tensor]] = {}

    def compute(self, k: int, t: int, group: int, carry: Any) -> Any:
        step = self.first[k] if t == 0 else self.later[k]
        carry, self.caches[k, group] = step(carry, self.caches.get((k, group), []))
        return carry


@dataclass
class DecodeStep(StepState):
    """A step of the decode schedule: a forward pass that also holds the generation's run."""

    run: Optional[Run] = None


def _received(step: StepState, stage: Any, key: Any) -> Any:
    message = take(step, stage, key)
    tensors = iter(message.parcel.tensors)
    return unflatten([next(tensors) if x is TENSOR else x for x in message.constants],
                     message.spec)


def forward(step: DecodeStep, stage: Any, action: Action) -> None:
    """F of the decode schedule: one group through model stage ``k`` at iteration ``t``. A
    group that finished passes ``None`` along (nothing is computed, its caches go)."""
    run = step.run
    w, group = stage.index, action.microbatch
    k, t = w % run.model_stages, w // run.model_stages
    route = step.routes[w, action.kind, group]
    if route.input is None:
        carry = run.feeders[group].first()
    else:
        value = _received(step, stage, route.input)
        carry = value if k > 0 or value is None else run.feeders[group].next(value)
    if carry is None:
        out = None
        run.caches.pop((k, group), None)
    else:
        out = run.compute(k, t, group, carry)
        if k == run.model_stages - 1:
            out = run.picker.pick(group, t, out[0])
    if route.output is not None:
        post(step, *route.output, out, detach=True)


HANDLERS = {ActionKind.FORWARD: forward}


@functools.lru_cache(maxsize=32)
def schedule_for(num_stages: int, groups: int, steps: int,
                 placement: Tuple[Tuple[int, ...], ...]) -> Schedule:
    """The decode schedule of a layout, validated once (cached)."""
    schedule = decode(num_stages, groups, steps, placement)
    validate_decode(schedule, comm="buffered")
    return schedule


def run_schedule(driver: Any, schedule: Schedule, stages: Sequence[Any], run: Run,
                 timeout: float) -> None:
    """Run the decode schedule on the pipe's executors: ``stages`` are the pipe's (model
    order; another process's are stand-ins)."""
    k = len(stages)
    unrolled = [(Unrolled(w, stages[w % k]) if getattr(stages[w % k], "module", None) is not None
                 else RemoteStage(w, stages[w % k].device))
                for w in range(schedule.num_virtual_stages)]
    step = DecodeStep(StepConfig(tuple(unrolled), timeout), inputs=[], train=False, seed=0,
                      checkpoint_stop=0, grad_enabled=False, handlers=HANDLERS, run=run)
    local = [s for s in stages if getattr(s, "module", None) is not None]
    order_streams(local, before=True)
    try:
        if driver.distributed:
            _run_on_ranks(driver, schedule, step)
        else:
            driver.workers.executor().run(schedule.actions, step, schedule)
    finally:
        order_streams(local, before=False)


def _run_on_ranks(driver: Any, schedule: Schedule, step: DecodeStep) -> None:
    """This rank's share, on an executor of the unrolled layout over the pipe's transport and
    failure board."""
    topology = driver.topology
    k = len(topology.owner)
    owner = [topology.owner[w % k] for w in range(schedule.num_virtual_stages)]
    executor = distributed_executor(
        Topology(owner, topology.rank, topology.stage, topology.group, topology.device),
        driver.board, None, (), grouped=driver.p2p == "grouped")
    executor.wire(step, schedule)
    executor.expect(schedule, schedule.actions, None)
    executor.run(schedule.actions, step, schedule)
