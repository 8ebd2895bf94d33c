"""What a front door's driver supplies to the shared step lifecycle (``fastpipe.frontdoor``).

The lifecycle (argument checks, micro-batch split, loss weighting, automatic choices, tracing)
is written once; a driver says where the stages run and how the processes that run them agree:
``InProcessDriver`` (every stage in this process, on worker threads and CUDA streams) and
``PerRankDriver`` (one process per pipeline rank, messages over ``torch.distributed``).
The defaults here are those of a driver that runs every stage itself.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch

from ..schedule import Action, Schedule
from ..schedule.timeline import Timeline
from .step import StepState
from .trace import StepRecorder


class Driver:
    """The part of a step that differs between front doors."""

    #: the virtual stages this process runs (their inputs, targets and outputs are read here)
    local: List[int]
    #: whether this process searches the micro-batch count of ``chunks='auto'`` (the others
    #: follow the count the first stage announces)
    searches_chunks: bool = True
    #: whether ``chunks`` shows the next step's count after a step (else the last step's)
    shows_next_count: bool = True
    #: whether this process logs the automatic choices (one process per pipeline does)
    reports: bool = True
    #: data-parallel replicas of this process's stages, whose gradients are averaged
    replicas: int = 1

    def guarded(self) -> ContextManager[None]:
        """Wraps every step: refuses or reports failures where processes must agree on them."""
        return contextlib.nullcontext()

    def forward_grad_mode(self) -> ContextManager[Any]:
        """The grad mode of ``forward``: the caller's, or off where no graph can span the
        stages."""
        return contextlib.nullcontext()

    def check_present(self, inputs: Any, targets: Any, reads_targets: bool) -> None:
        """Checks, before any work, that this process was given what it reads."""

    def agree(self, step: StepState, sizes: Optional[List[int]], train: bool,
              fixed: Optional[Callable[[int], List[int]]],
              plan: Callable[..., Schedule]) -> List[int]:
        """The step's micro-batch sizes, agreed by every process (``sizes``: those this
        process computed from its batch, ``None`` when it reads none; ``fixed(n)``: the sizes
        a batch of ``n`` splits into, ``None`` under ``chunks='auto'``; ``plan(m)``: the
        schedule of ``m`` micro-batches, of the current count without ``m``), and the step
        wired for them."""
        assert sizes is not None
        return sizes

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        raise NotImplementedError  # pragma: no cover - each driver runs its programs

    def timeline(self, recorder: StepRecorder) -> Timeline:
        """The whole pipeline's measured timeline of the recorded step."""
        raise NotImplementedError  # pragma: no cover

    def loss(self, step: StepState, num_microbatches: int) -> Tuple[torch.Tensor, Optional[float]]:
        """The step's loss from the weighted micro-batch losses, and with ``(loss_sum, count)``
        losses the whole step's count (the loss is then the sums over it), else ``None``."""
        raise NotImplementedError  # pragma: no cover

    def average_gradients(self) -> None:
        """After the backward: average the gradients over data-parallel replicas."""

    def sum_tied_gradients(self) -> None:
        """Then sum the gradients of weights tied across processes."""

    def before_update(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any]) -> None:
        """Before the front door steps ``optimizer`` (through ``scaler`` when given)."""

    def wait_for_devices(self) -> None:
        """Wait for the step's queued device work, so a measured step time covers it."""
