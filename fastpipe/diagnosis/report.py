"""``fastpipe.doctor``: diagnose a measured pipeline step and say what to change.

``doctor(trace)`` takes what ``with pipe.trace() as t:`` gives (or one of its timelines, or a trace
file's timeline and context from :func:`fastpipe.schedule.trace_file.load_trace`) and returns a
:class:`Diagnosis`: the step's time split per stage (:mod:`fastpipe.diagnosis.split`) and the
findings ranked by expected gain (:mod:`fastpipe.diagnosis.findings`). ``print(diagnosis)`` shows a
short table and at most five lines of advice. Pure Python: no device work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from .findings import Finding, Memory, find
from ..schedule.trace_file import StepContext, TraceFileError, check_timeline
from .split import CATEGORIES, Split, split_step
from ..schedule.timeline import Timeline

__all__ = ["Diagnosis", "doctor", "MAX_ADVICE"]

MAX_ADVICE = 5
_HEADERS = {"compute": "compute", "inherent": "bubble", "imbalance": "imbalance",
            "communication": "comm", "input": "input", "optimizer": "optimizer",
            "unexplained": "other"}


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer for one step: ``split`` (seconds per stage and category, see
    :class:`~fastpipe.diagnosis.split.Split`), ``findings`` (largest expected gain first) and the
    ``context`` it used."""

    split: Split
    findings: Tuple[Finding, ...]
    context: StepContext

    @property
    def step_time(self) -> float:
        """Seconds from the step's start (waiting for input) to ``train_step``'s return."""
        return self.split.step_time

    def share(self, category: str, stage: Optional[int] = None) -> float:
        """Share of the step in ``category`` (one of :data:`CATEGORIES`), for one stage or all."""
        if category not in CATEGORIES:
            raise ValueError(f"category={category!r}; use one of {', '.join(CATEGORIES)}")
        return self.split.share(category, stage)

    def finding(self, kind: str) -> Optional[Finding]:
        """The finding of ``kind``, if any."""
        return next((f for f in self.findings if f.kind == kind), None)

    def report(self) -> str:
        """The printed report: a header, the per-stage table, at most five lines of advice."""
        lines = [self._header(), "", self._table(), ""]
        if not self.findings:
            lines.append("no problem found: every fix the doctor knows would gain under "
                         "5% of the step")
        for number, f in enumerate(self.findings[:MAX_ADVICE], 1):
            gain = f"[-{f.gain / self.step_time:.0%} step]" if f.gain > 0 else "[risk]"
            lines.append(f"{number}. {gain} {f.message}" + (f"; {f.fix}" if f.fix else ""))
        return "\n".join(lines)

    __str__ = report

    def _header(self) -> str:
        schedule = self.split.schedule
        rate = (f", {self.context.samples / self.step_time:.1f} samples/s"
                if self.context.samples and self.step_time > 0 else "")
        return (f"step {self.step_time * 1e3:.3g} ms{rate}: schedule {schedule.name!r}, "
                f"{schedule.num_stages} stages, {schedule.num_microbatches} micro-batches; "
                f"simulated with the measured costs {self.split.simulated * 1e3:.3g} ms, with "
                f"equal stages {self.split.equalized * 1e3:.3g} ms")

    def _table(self) -> str:
        headers = ["stage", *(_HEADERS[c] for c in CATEGORIES)]
        rows = [[str(s), *(f"{self.share(c, s):.0%}" for c in CATEGORIES)]
                for s in range(len(self.split.seconds))]
        rows.append(["all", *(f"{self.share(c):.0%}" for c in CATEGORIES)])
        return _table(headers, rows)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c) for c in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(line, widths))
                     for line in [headers, *rows])


def doctor(timeline_or_trace: Any, *, memory: Union[Memory, Sequence[float], None] = None,
           context: Optional[StepContext] = None, step: int = -1) -> Diagnosis:
    """Diagnose one measured training step.

    ``timeline_or_trace``: a ``Trace`` from ``pipe.trace()`` (its ``step``-th step, default the
    last; it carries the step's context), a measured ``Timeline``, or a ``(timeline, context)`` pair
    from :func:`fastpipe.schedule.trace_file.load_trace`. ``memory``: per-stage peak bytes, or a
    :class:`~fastpipe.diagnosis.findings.Memory` with limits, for the checkpoint advice (default:
    what the trace recorded, the CUDA peak and capacity of each stage's device).
    ``context``: fields that override the recorded ones (e.g. ``balance`` for a bare timeline).
    Raises :class:`~fastpipe.schedule.trace_file.TraceFileError` for input it cannot diagnose.
    """
    timeline, recorded = _unpack(timeline_or_trace, step)
    timeline = check_timeline(timeline)
    context = recorded.merged(context)
    if memory is None and context.memory_peak is not None:
        memory = Memory(context.memory_peak, context.memory_limit)
    stats = _memory(memory, timeline)
    split = split_step(timeline, context)
    return Diagnosis(split, tuple(find(split, context, stats)), context)


def _unpack(value: Any, step: int) -> Tuple[Timeline, StepContext]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], StepContext):
        return value
    if isinstance(value, Timeline):
        return value, StepContext()
    timelines = getattr(value, "timelines", None)
    if isinstance(timelines, list):
        if not timelines:
            raise TraceFileError("the trace holds no step: run a train_step inside "
                                   "pipe.trace()")
        try:
            index = range(len(timelines))[step]
        except IndexError:
            raise TraceFileError(f"step={step} is outside the trace's {len(timelines)} "
                                   f"steps") from None
        return timelines[index], value.contexts.get(index, StepContext())
    raise TraceFileError(f"expected a Trace from pipe.trace(), a Timeline or (timeline, "
                           f"context), got {type(value).__name__}")


def _memory(memory: Union[Memory, Sequence[float], None], timeline: Timeline) -> Optional[Memory]:
    if memory is None or isinstance(memory, Memory):
        found = memory
    else:
        try:
            found = Memory(tuple(float(x) for x in memory))
        except (TypeError, ValueError):
            raise TraceFileError(f"memory must be peak bytes per stage (numbers) or a Memory, "
                                   f"got {memory!r}") from None
    if found is not None and len(found.peak) != timeline.num_stages:
        raise TraceFileError(f"memory has {len(found.peak)} entries for a timeline of "
                               f"{timeline.num_stages} stages; give one per stage")
    return found
