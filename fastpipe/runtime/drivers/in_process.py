"""The driver of ``Pipe``: every stage in this process, run by worker threads.

Around each step it orders the stages' CUDA streams after the caller's work and back, replays
or captures CUDA graphs, and lets the worker policy pick the thread count of the next step.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple

import torch

from ...policies import batchnorm
from ...policies.tied import TiedGradients
from ...schedule import Action, Schedule
from ...schedule.timeline import Timeline
from .. import graphs
from .base import Driver
from ..stage import Stage, order_streams
from ..step import StepState
from ..observe.trace import StepRecorder, wait_for


class WorkerPool(Protocol):
    """Who runs a step's programs (``fastpipe.autotune.workers.WorkerPolicy``): the executor
    with the current thread count, told about each finished step."""

    def executor(self) -> Any: ...

    def observe(self, step: StepState) -> None: ...


class InProcessDriver(Driver):
    """Runs a step's programs on this process's worker threads."""

    def __init__(self, stages: Sequence[Stage], devices: Sequence[torch.device],
                 workers: WorkerPool, tied_grads: TiedGradients, timeout: float) -> None:
        self.stages = list(stages)
        self.devices = tuple(devices)
        self.workers = workers
        self.tied_grads = tied_grads
        self.timeout = timeout
        self.local = list(range(len(self.stages)))

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        order_streams(self.stages, before=True)
        batchnorm.discard(self.stages)
        graphs.before_step(self.stages, step.train)
        self.tied_grads.begin(step.train and step.handlers is None)  # not under PipeDream
        try:
            self.workers.executor().run(programs, step, schedule)
        finally:
            order_streams(self.stages, before=False)
        self.tied_grads.flush()  # tied weights' gradients, summed in stage order
        graphs.after_step(self.stages)
        batchnorm.commit(self.stages)
        self.workers.observe(step)

    def timeline(self, recorder: StepRecorder) -> Timeline:
        return recorder.timeline(dict(enumerate(self.devices)), self.timeout)

    def loss(self, step: StepState,
             num_microbatches: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        loss = torch.stack([step.losses[i] for i in range(num_microbatches)]).sum()
        token_mean = step.token_mean
        if token_mean is None or not token_mean.active:
            return loss, None
        total = token_mean.total(loss.device)
        return torch.where(total > 0, loss / total.to(loss.dtype), loss * 0.0), total

    def wait_for_devices(self) -> None:
        wait_for(self.devices, self.timeout)
