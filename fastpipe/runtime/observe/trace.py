"""Measured timelines: when each action of a step really started and ended, on every stage.

CPU stages are timed with the monotonic clock around each action. CUDA stages record a pair of
timing events on the stage's stream around each action, read once the step has finished and
placed on the same clock through an event recorded when the step began. The result is the same
``Timeline`` the simulator produces, so a plan and a run can be drawn and compared alike.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...schedule.trace_file import StepContext, merge_chrome_traces
from ...errors import PipelineTimeout
from ...schedule import Action
from ...schedule.render import chrome_trace
from ...schedule.timeline import Timeline


@dataclass
class StepRecorder:
    """Collects (stage, action, start, end) of one step; seconds since the step began. On a
    CPU stage it also sums, per stage, the CPU time its thread got during its actions and
    their wall time (``cpu``: stage -> [cpu seconds, wall seconds]): how much of a core the
    stage had, whatever else ran on the machine."""

    num_stages: int
    origin: float = field(default_factory=time.perf_counter)
    intervals: List[Tuple[int, Action, float, float]] = field(default_factory=list)
    pending: List[Tuple[int, Action, Any, Any]] = field(default_factory=list)
    bases: Dict[torch.device, Tuple[Any, float]] = field(default_factory=dict)
    cpu: Dict[int, List[float]] = field(default_factory=dict)

    def begin(self, stage: Any) -> Optional[Any]:
        """Mark the start of an action on ``stage``; returns what ``end`` needs."""
        if stage.stream is None:
            return time.perf_counter(), time.thread_time()
        self._base(stage.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(stage.stream)
        return event

    def end(self, stage: Any, action: Action, token: Any) -> None:
        """Mark the end of ``action`` started with ``token``."""
        if stage.stream is None:
            now, used = time.perf_counter(), time.thread_time() - token[1]
            self.intervals.append((action.stage, action, token[0] - self.origin,
                                   now - self.origin))
            total = self.cpu.setdefault(action.stage, [0.0, 0.0])
            total[0] += used
            total[1] += now - token[0]
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(stage.stream)
        self.pending.append((action.stage, action, token, event))

    def _base(self, device: torch.device) -> None:
        if device not in self.bases:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self.bases[device] = (event, time.perf_counter() - self.origin)

    def resolved(self, devices: Dict[int, torch.device],
                 timeout: float) -> List[Tuple[int, Action, float, float]]:
        """Every (stage, action, start, end), CUDA events read (waiting at most ``timeout``
        seconds for each)."""
        intervals = list(self.intervals)
        for stage, action, start, end in self.pending:
            _wait_for(end, timeout, stage, action)
            base, offset = self.bases[devices[stage]]
            intervals.append((stage, action, offset + base.elapsed_time(start) / 1e3,
                              offset + base.elapsed_time(end) / 1e3))
        return intervals

    def timeline(self, devices: Dict[int, torch.device], timeout: float) -> Timeline:
        """The step's measured timeline (waits, at most ``timeout`` seconds each, for the CUDA
        events it still has to read)."""
        return Timeline.from_intervals(self.num_stages, self.resolved(devices, timeout),
                                       source="measured", unit="s")


def _wait_for(event: Any, timeout: float, stage: int, action: Action) -> None:
    """Wait for the event recorded after ``action``; a GPU that never finishes raises."""
    wait_for_event(event, timeout, f"the GPU to finish action {action} (micro-batch "
                   f"{action.microbatch}) of stage {stage} while reading its trace",
                   stage=stage, action=str(action), microbatch=action.microbatch)


def wait_for_event(event: Any, timeout: float, what: str, **where: Any) -> None:
    """Poll a CUDA event until it completed, at most ``timeout`` seconds (a plain
    ``synchronize`` would wait forever on a GPU that never finishes); ``what`` it stands for
    and ``where`` (stage, action, micro-batch) go into the error."""
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise PipelineTimeout(f"timed out after {timeout:g}s waiting for {what}", **where)
        time.sleep(1e-4)


def wait_for(devices: Sequence[torch.device], timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) for the GPUs' queued work, so a measured step time
    covers the work, not its launch."""
    for device in set(devices):
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            wait_for_event(event, timeout, f"{device} to finish the step timed for "
                                           f"chunks='auto'")



class Trace:
    """What ``with pipe.trace() as t:`` gives: the measured timeline of every step inside, and
    for each training step its context (when it began waiting for input, when it returned, its
    layout), which ``fastpipe.doctor(t)`` and :meth:`write` use."""

    def __init__(self) -> None:
        self.timelines: List[Timeline] = []
        self.contexts: Dict[int, StepContext] = {}  # timeline index -> its training step's
        self.opened = time.perf_counter()  # the block's start: the first step's input wait
        self.last_end: Optional[float] = None  # when the last training step returned

    def write(self, path: Union[str, "os.PathLike[str]"], step: int = -1,
              merge_with: Optional[Union[str, "os.PathLike[str]"]] = None) -> None:
        """Write the ``step``-th step (default: the last) as Chrome/Perfetto trace JSON, with
        its context, for ui.perfetto.dev and ``python -m fastpipe doctor``. ``merge_with``: a
        ``torch.profiler`` Chrome trace of the same step to write into the same file."""
        timeline = self.timelines[step] if self.timelines else self.timeline
        context = self.contexts.get(range(len(self.timelines))[step])
        data = chrome_trace(timeline, meta=None if context is None else {
            "num_stages": timeline.num_stages, **context.to_dict(), **self._step_times()})
        if merge_with is not None:
            with open(merge_with, encoding="utf-8") as file:
                data = merge_chrome_traces(data, json.load(file))
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)

    def _step_times(self) -> Dict[str, List[float]]:
        """Every traced training step's seconds, when there are several (their spread is the
        noise ``fastpipe.doctor`` weighs its advice against)."""
        times = [c.step_end - c.step_start for c in self.contexts.values()
                 if c.step_end is not None and c.step_start is not None]
        return {"step_times": times} if len(times) > 1 else {}

    @property
    def timeline(self) -> Timeline:
        """The last step's timeline."""
        if not self.timelines:
            raise RuntimeError("no step ran inside pipe.trace(); call pipe.train_step(...) or "
                               "pipe(x) inside the with block")
        return self.timelines[-1]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the last step: 1 - busy time / (stages x step time)."""
        return self.timeline.bubble_fraction

    @property
    def busy(self) -> Tuple[float, ...]:
        """Seconds each stage spent in actions during the last step."""
        return self.timeline.busy
