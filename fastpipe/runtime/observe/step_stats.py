"""``pipe.last_step``: the last training step's figures, measured without tracing, and the
step context the doctor needs when the step is traced.

At the end of every training step a front door keeps :func:`finish_step`'s record: the step's
samples/s, wall time and measured bubble share (from the seconds each worker spent in actions,
which the executor counts anyway). Inside ``pipe.trace()`` it also records
:func:`step_context`'s :class:`~fastpipe.schedule.trace_file.StepContext`: when the step began
waiting for its input, when it returned, its schedule, balance and batch size. Both are pure
functions of what they are given.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ...schedule.trace_file import StepContext
from ...placement import worker_groups
from ..step import StepState

__all__ = ["StepShape", "StepStats", "finish_step", "step_context"]

_REMOTE = "on another rank"  # a stage another process runs (see dist_executor)


@dataclass(frozen=True)
class StepStats:
    """One training step: ``samples`` in ``step_time`` seconds (the ``train_step`` call, on the
    host), with ``busy`` seconds of actions on the ``stages`` physical stages this process runs
    (all of a ``Pipe``, one of a ``DistributedPipe`` rank): from the executor's count, or from
    the trace when the step was traced (device time on GPUs); ``None`` for CUDA stages not
    traced, whose actions the host only launches. ``grad_norm``: the whole model's gradient
    norm when the step measured it (clipping, or the non-finite check), before clipping;
    ``skipped``: the optimizer step was skipped (a non-finite step under ``nonfinite='skip'``,
    or a GradScaler's verdict). ``host_reads``: the blocking reads of device buffers this
    process made on the host during the step, by its transport and at the step's close (each
    one, on a GPU, makes the host wait for the device): none in the grouped transport; one at
    the close when the host needs a verdict (the non-finite check, clipping, a count to
    check), none otherwise."""

    samples: int
    step_time: float
    busy: Optional[float]
    stages: int
    grad_norm: Optional[float] = None
    skipped: bool = False
    host_reads: Optional[int] = None

    @property
    def samples_per_second(self) -> float:
        """Throughput of the step."""
        return self.samples / self.step_time if self.step_time > 0 else float("inf")

    @property
    def bubble_fraction(self) -> Optional[float]:
        """Share of stage-time not spent in actions during the step, ``1 - busy / (stages x
        step_time)`` (waiting, and the step's own bookkeeping); ``None`` on untraced CUDA
        stages, whose actions the host only launches."""
        if self.busy is None or self.step_time <= 0:
            return None
        return max(0.0, 1.0 - self.busy / (self.stages * self.step_time))

    @property
    def summary(self) -> str:
        """``'2640.3 samples/s, bubble 23.4%'``."""
        bubble = self.bubble_fraction
        shown = "n/a" if bubble is None else f"{bubble:.1%}"
        return f"{self.samples_per_second:.1f} samples/s, bubble {shown}"

    def __str__(self) -> str:
        return f"{self.samples} samples in {self.step_time * 1e3:.1f} ms: {self.summary}"


@dataclass(frozen=True)
class StepShape:
    """What a front door says of its pipe for a traced step's context: the schedule, virtual
    stages, balance and checkpoint mode, and the devices of the stages when this process runs
    them all, one per physical stage (a ``Pipe``: its worker threads and GPU memory are
    reported), else ``None``."""

    schedule: str
    virtual_stages: int
    balance: Tuple[int, ...]
    checkpoint: str
    devices: Optional[Tuple[torch.device, ...]] = None


def finish_step(step: StepState, samples: int, started: float, ended: float,
                timeline: Any = None) -> StepStats:
    """The record of a finished training step that ran ``samples`` samples from ``started``
    to ``ended`` (``time.perf_counter()``); ``timeline``: its measured timeline when traced."""
    return StepStats(samples, ended - started, _busy(step, timeline), _local_stages(step),
                     step.grad_norm, step.skipped, host_reads=step.reads.count)


def step_context(step: StepState, samples: int, started: float, ended: float, trace: Any,
                 shape: StepShape) -> StepContext:
    """The context of a traced training step (``trace``: the ``Trace`` whose last timeline is
    the step's), on that timeline's clock: when it began waiting for its input (the end of the
    trace's previous training step, else the opening of the block), was called and ended."""
    timeline = trace.timelines[-1]
    origin = step.recorder.origin
    offset = _offset(step, timeline)
    began = trace.last_end if trace.last_end is not None else trace.opened
    return StepContext(
        step_start=began - origin + offset, step_called=started - origin + offset,
        step_end=ended - origin + offset, action_overhead=_action_overhead(step),
        threads=_threads(shape.devices, step), **_cuda_memory(shape.devices, step),
        cpu_busy=_cpu_busy(step, trace.timelines[-1].num_stages),
        **_hardware(shape.devices),
        schedule=shape.schedule, virtual_stages=shape.virtual_stages, balance=shape.balance,
        samples=samples, checkpoint=shape.checkpoint)


CPU_ACTION_OVERHEAD = 20e-6
"""Seconds an action costs on a CPU stage beyond its layers' work (handler, mailbox, autograd
set-up): the median F of a one-weight stage, measured by ``benchmarks/doctor_overhead.py``. The
doctor adds it to the gaps it sees between actions when it predicts other micro-batch counts."""


def _action_overhead(step: StepState) -> Optional[float]:
    """The fixed cost per action the doctor should assume (known for CPU stages only)."""
    if any(getattr(stage, "stream", None) is not None for stage in step.config.stages):
        return None
    return CPU_ACTION_OVERHEAD


def _threads(devices: Optional[Tuple[torch.device, ...]],
             step: StepState) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """The stages each worker thread of a ``Pipe`` ran this step (one per GPU stage, the CPU
    stages in as many groups as the step had CPU workers); ``None`` for other front doors."""
    if devices is None or len(devices) != _local_stages(step):
        return None
    gpu = sum(1 for d in devices if d.type != "cpu")
    groups = worker_groups(devices, max(1, len(step.busy) - gpu))
    return tuple(tuple(group) for group in groups)


def _cuda_memory(devices: Optional[Tuple[torch.device, ...]],
                 step: StepState) -> Dict[str, Tuple[float, ...]]:
    """Per stage of a ``Pipe`` whose stages are all on GPUs, the peak bytes allocated on its
    device (since the last reset) and the device's capacity; nothing otherwise."""
    if devices is None or len(devices) != _local_stages(step) or not all(
            d.type == "cuda" for d in devices):
        return {}
    return {"memory_peak": tuple(float(torch.cuda.max_memory_allocated(d)) for d in devices),
            "memory_limit": tuple(float(torch.cuda.get_device_properties(d).total_memory)
                                  for d in devices)}


def _hardware(devices: Optional[Tuple[torch.device, ...]]) -> Dict[str, Any]:
    """What the doctor needs to know of the hardware: the stages' devices (when this process
    runs them all), the cores this process may use, torch's intra-op threads, the load."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"devices": None if devices is None else tuple(str(d) for d in devices),
            "cores": len(cores) if cores else os.cpu_count(),
            "intra_op_threads": torch.get_num_threads(), "load": load}


def _cpu_busy(step: StepState, num_stages: int) -> Optional[Tuple[float, ...]]:
    """Per stage, the CPU time its thread got over the wall time of its actions (every
    rank's, once a ``DistributedPipe`` gathered them); ``None`` unless every stage has it."""
    cpu = step.recorder.cpu
    if set(cpu) != set(range(num_stages)):
        return None
    return tuple(min(1.0, c / w) if w > 0 else 1.0 for c, w in (cpu[s] for s in
                                                                  range(num_stages)))


def _local_stages(step: StepState) -> int:
    return max(1, sum(1 for state, _ in step.progress if state != _REMOTE))


def _busy(step: StepState, timeline: Any) -> Optional[float]:
    """Seconds of actions on this process's stages: from the trace when there is one (device
    time on GPUs), else the executor's count (host time: no figure for CUDA stages)."""
    if timeline is not None and step.recorder is not None:
        mine = {stage for stage, *_ in step.recorder.intervals} | {
            stage for stage, *_ in step.recorder.pending}
        return sum(timeline.busy[s] for s in mine) if mine else None
    if any(getattr(stage, "stream", None) is not None for stage in step.config.stages):
        return None
    return sum(step.busy)


def _offset(step: StepState, timeline: Any) -> float:
    """Seconds to add to this process's recorder times to land on ``timeline``'s clock (0 for a
    ``Pipe``; the gathered timeline of a ``DistributedPipe`` starts at the earliest rank)."""
    if not step.recorder.intervals:
        return 0.0
    stage, action, start, _ = step.recorder.intervals[0]
    for event in timeline.events:
        if event.stage == stage and event.action == action:
            return event.start - start
    return 0.0
