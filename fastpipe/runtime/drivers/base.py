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

from ...schedule import Action, Schedule
from ...schedule.timeline import Timeline
from ..gradients import closing, grad_norm, readout
from ..step import StepState
from ..transport.wire import HostReads
from ..observe.trace import StepRecorder


class Driver:
    """The part of a step that differs between front doors."""

    #: the virtual stages this process runs (their inputs, targets and outputs are read here)
    local: List[int]
    #: every virtual stage of the pipeline (another process's: a stand-in without a module)
    stages: List[Any]
    #: whether this process searches the micro-batch count of ``chunks='auto'`` (the others
    #: follow the count the first stage announces)
    searches_chunks: bool = True
    #: whether ``chunks`` shows the next step's count after a step (else the last step's)
    shows_next_count: bool = True
    #: whether this process logs the automatic choices (one process per pipeline does)
    reports: bool = True
    #: data-parallel replicas of this process's stages, whose gradients are averaged
    replicas: int = 1
    #: this process's rank (named in errors), and whether there are other processes
    rank: int = 0
    distributed: bool = False

    @property
    def norm_device(self) -> torch.device:
        """Where a gradient norm is returned: the device of this process's first stage."""
        return self.stages[self.local[0]].device

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

    def loss(self, step: StepState,
             num_microbatches: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The step's loss from the weighted micro-batch losses, and with ``(loss_sum, count)``
        losses the whole step's count (the loss is then the sums over it), else ``None``; both
        computed on the device, unread."""
        raise NotImplementedError  # pragma: no cover

    def replica_sums(self, values: List[float]) -> List[float]:
        """``values`` added over the data-parallel replicas of this process's stages (a
        collective of the processes that run the same stages; here, one process: as given)."""
        return list(values)

    def begin_training(self, sync: bool) -> None:
        """Before a training step: ``sync`` is False inside ``no_sync()``, where the gradients
        of the step stay this process's own (no data-parallel or tied-weight sums) until a
        later call syncs them."""

    def finish_gradients(self, step: StepState, count: Optional[torch.Tensor]) -> None:
        """After the backward: make the step's gradients final: averaged over data-parallel
        replicas, divided by the token count of ``(loss_sum, count)`` losses (``count``, a
        device tensor, else ``None``), weights tied across processes summed."""
        if count is not None:
            step.token_mean.finish(count)

    def before_update(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any],
                      reads: HostReads) -> bool:
        """Before the front door steps ``optimizer`` through ``scaler``: unscale the gradients
        (so they can be measured and clipped); whether the scaler found an inf or NaN in them
        (it then skips the step, on every process alike; one read, counted in ``reads``)."""
        scaler.unscale_(optimizer)
        return scaler_found_inf(scaler, optimizer, reads)

    def counted(self, named: Sequence[Tuple[str, Any]]) -> List[grad_norm.Counted]:
        """The parameters this process counts in the model's gradient norm (each element of
        the model's gradient counted once over all processes)."""
        return grad_norm.counted(named, self.stage_of())

    def stage_of(self) -> dict:
        """Parameter id -> the virtual stage of this process that holds it."""
        found: dict = {}
        for stage in self.stages:  # a weight tied across stages: its first (home) stage
            module = getattr(stage, "module", None)  # None: another process's stage
            for p in module.parameters() if module is not None else ():
                found.setdefault(id(p), stage.index)
        return found

    def gather_reports(self, report: "closing.Report") -> List["closing.Report"]:
        """Every process's report of the step (here, one process: its own). A
        ``DistributedPipe`` gathers them in one collective, which confirms the step."""
        return [report]

    def name_of(self, culprit: "closing.Report", counted: Sequence[grad_norm.Counted]) -> str:
        """The plain-model name of the culprit's first non-finite gradient."""
        return counted[culprit.bad_parameter].name

    def check_synced(self, what: str) -> None:
        """Raise when the gradients are not final (a ``no_sync()`` window is open)."""

    def wait_for_devices(self) -> None:
        """Wait for the step's queued device work, so a measured step time covers it."""


def scaler_found_inf(scaler: Any, optimizer: torch.optim.Optimizer, reads: HostReads) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` found an inf or NaN gradient (one host read of
    every device's flag together: the front door needs the verdict to report the step as
    skipped)."""
    if not scaler.is_enabled():
        return False
    found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    return any(v > 0 for v in readout.read_together(found, reads) if v is not None)
