"""``fastpipe.doctor``: diagnose a measured pipeline step and say what to change.

``doctor(trace)`` takes what ``with pipe.trace() as t:`` gives (or one of its timelines, or a trace
file's timeline and context from :func:`fastpipe.schedule.trace_file.load_trace`) and returns a
:class:`Diagnosis`: the median step's time split per stage (:mod:`fastpipe.diagnosis.split`) and
the findings ranked by expected gain (:mod:`fastpipe.diagnosis.findings`), each traced step
diagnosed on its own, its hardware read (:mod:`fastpipe.diagnosis.hardware`) and the advice
weighed against the steps' spread (:mod:`fastpipe.diagnosis.confidence`). ``print(diagnosis)``
shows a short table and at most five lines of advice. Pure Python: no device work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import hardware
from .confidence import Noise, weigh
from .findings import Finding, Memory, find
from .layers import check_profile
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
    ``context`` it used; ``noise``: the traced steps' spread the findings were weighed
    against."""

    split: Split
    findings: Tuple[Finding, ...]
    context: StepContext
    noise: Noise = Noise(1, None)

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
                         "5% of the step, or less than the traced steps' spread")
        for number, f in enumerate(self.findings[:MAX_ADVICE], 1):
            lines.append(f"{number}. {self._tag(f)} {f.message}" + (f"; {f.fix}" if f.fix else ""))
            if f.evidence:
                lines.append(f"   {f.confidence} confidence: {f.evidence}")
        return "\n".join(lines)

    def _tag(self, finding: Finding) -> str:
        if finding.kind == "hardware":
            return "[hardware]"
        if finding.gain <= 0:
            return "[risk]"
        share = finding.gain / self.step_time if self.step_time > 0 else 0.0
        return f"[-{share:.0%} step, {finding.confidence or 'low'} confidence]"

    __str__ = report

    def _header(self) -> str:
        schedule = self.split.schedule
        rate = (f", {self.context.samples / self.step_time:.1f} samples/s"
                if self.context.samples and self.step_time > 0 else "")
        return (f"step {self.step_time * 1e3:.3g} ms{rate}: schedule {schedule.name!r}, "
                f"{schedule.num_stages} stages, {schedule.num_microbatches} micro-batches; "
                f"simulated with the measured costs {self.split.simulated * 1e3:.3g} ms, with "
                f"equal stages {self.split.equalized * 1e3:.3g} ms; {self.noise.describe()}")

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
           context: Optional[StepContext] = None, step: Optional[int] = None,
           layer_costs: Optional[Sequence[float]] = None) -> Diagnosis:
    """Diagnose the measured training steps of a trace.

    ``timeline_or_trace``: a ``Trace`` from ``pipe.trace()`` (every training step in it, or the
    ``step``-th one; each carries its context), a measured ``Timeline``, or a ``(timeline,
    context)`` pair from :func:`fastpipe.schedule.trace_file.load_trace`. Each step is
    diagnosed on its own and the advice weighed against the steps' spread: trace five or more
    steps (one step gives advice of unknown noise, 'low' confidence). ``memory``: per-stage
    peak bytes, or a :class:`~fastpipe.diagnosis.findings.Memory` with limits, for the
    checkpoint advice (default: what the trace recorded, the CUDA peak and capacity of each
    stage's device). ``context``: fields that override the recorded ones (e.g. ``balance`` for
    a bare timeline). ``layer_costs``: a per-layer cost profile in model order (e.g.
    :func:`fastpipe.layer_costs.profile_times`), to split each stage's measured time over its
    layers when proposing a balance (default: evenly).
    Raises :class:`~fastpipe.schedule.trace_file.TraceFileError` for input it cannot diagnose.
    """
    steps = [(check_timeline(t), c) for t, c in _unpack(timeline_or_trace, step)]
    override = (context or StepContext()).merged(
        None if layer_costs is None else StepContext(layer_costs=tuple(layer_costs)))
    contexts = [recorded.merged(override) for _, recorded in steps]
    for found in contexts:
        check_profile(found.layer_costs, found.balance)
    stats = _memory(_recorded_memory(memory, contexts[-1]), steps[-1][0])
    splits = [split_step(timeline, c) for (timeline, _), c in zip(steps, contexts)]
    per_step = [hardware.apply(find(split, c, stats), c, split.schedule.num_stages)
                for split, c in zip(splits, contexts)]
    noise = _noise(splits, contexts[-1])
    middle = sorted(range(len(splits)), key=lambda i: splits[i].step_time)[(len(splits) - 1) // 2]
    return Diagnosis(splits[middle], tuple(weigh(per_step, noise)), contexts[middle], noise)


def _recorded_memory(memory: Union[Memory, Sequence[float], None],
                     context: StepContext) -> Union[Memory, Sequence[float], None]:
    if memory is None and context.memory_peak is not None:
        return Memory(context.memory_peak, context.memory_limit)
    return memory


def _noise(splits: Sequence[Split], context: StepContext) -> Noise:
    """The steps' spread (of the steps diagnosed, else of those a trace file lists) and the
    spread of each stage's compute time over the steps diagnosed."""
    if len(splits) == 1 and context.step_times is not None and len(context.step_times) > 1:
        return Noise.of(context.step_times)
    stages = [[row["compute"] for row in split.seconds] for split in splits]
    return Noise.of([split.step_time for split in splits], stages)


def _unpack(value: Any, step: Optional[int]) -> List[Tuple[Timeline, StepContext]]:
    """The (timeline, context) of each step to diagnose."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], StepContext):
        return [value]
    if isinstance(value, Timeline):
        return [(value, StepContext())]
    timelines = getattr(value, "timelines", None)
    if not isinstance(timelines, list):
        raise TraceFileError(f"expected a Trace from pipe.trace(), a Timeline or (timeline, "
                             f"context), got {type(value).__name__}")
    if not timelines:
        raise TraceFileError("the trace holds no step: run a train_step inside pipe.trace()")
    if step is None:
        trained = sorted(value.contexts)
        return ([(timelines[i], value.contexts[i]) for i in trained] if trained
                else [(timelines[-1], StepContext())])
    try:
        index = range(len(timelines))[step]
    except (IndexError, TypeError):
        raise TraceFileError(f"step={step!r} is outside the trace's {len(timelines)} "
                             f"steps") from None
    return [(timelines[index], value.contexts.get(index, StepContext()))]


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
