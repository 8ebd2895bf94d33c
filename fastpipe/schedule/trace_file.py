"""Trace files: a measured timeline and the step around it, written and read back.

The doctor's input.

A :class:`StepContext` says what a bare timeline does not: when the step began waiting for its
input (the end of the previous step, or the start of the ``trace()`` block), when it returned,
the schedule, the layers per stage and the batch size. ``trace()`` records it for every training
step and writes it into the Chrome/Perfetto JSON under ``otherData.fastpipe``; :func:`load_trace`
reads such a file back. Pure Python: no torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Tuple

from .actions import Action
from .render import MICROSECONDS_PER_UNIT
from .timeline import Timeline

__all__ = ["TraceFileError", "StepContext", "load_trace", "merge_chrome_traces",
           "timeline_from_chrome_trace"]

_ACTION_ARGS = ("stage", "kind", "microbatch", "chunk", "start", "end")


class TraceFileError(ValueError):
    """A trace (file or timeline) that cannot be read or used (reported in one line)."""


@dataclass(frozen=True)
class StepContext:
    """The step around a measured timeline; every time is on the timeline's clock (seconds).

    ``step_start``: when the step began waiting for its input (the previous step's return, or the
    start of the ``trace()`` block); ``step_called``: when ``train_step`` was called (its input
    in hand); ``step_end``: when it returned (after the optimizer when it was given one).
    ``balance``: layers per virtual stage in model order.
    ``placement``: the virtual stage of each (stage, chunk). ``samples``: the batch size.
    ``action_overhead``: fixed cost of one action in seconds, beyond what the timeline shows.
    ``threads``: the stages each worker thread ran (CPU stages may share one, and then never
    overlap). ``memory_peak`` and ``memory_limit``: per stage, the peak bytes allocated on its
    device and the device's capacity (recorded for CUDA stages).
    The hardware the stages ran on: ``devices`` (each physical stage's device), ``cores`` (the
    CPU cores this process may run on), ``intra_op_threads`` (``torch.get_num_threads()``) and
    ``load`` (the machine's one-minute load average at the step). ``layer_costs``: a per-layer
    cost profile in model order (any unit), to split a stage's measured time over its layers.
    ``step_times``: the seconds of every training step traced in the same block (their spread
    is the measurement's noise). ``cpu_busy``: per CPU stage, the CPU time its thread got over
    the wall time of its actions (about 1: a core of its own; 0.5: half of one).
    Unknown fields are ``None``; the doctor then skips the advice that needs them.
    """

    step_start: Optional[float] = None
    step_called: Optional[float] = None
    step_end: Optional[float] = None
    schedule: Optional[str] = None
    virtual_stages: Optional[int] = None
    placement: Optional[Tuple[Tuple[int, ...], ...]] = None
    balance: Optional[Tuple[int, ...]] = None
    samples: Optional[int] = None
    checkpoint: Optional[str] = None
    action_overhead: Optional[float] = None
    threads: Optional[Tuple[Tuple[int, ...], ...]] = None
    memory_peak: Optional[Tuple[float, ...]] = None
    memory_limit: Optional[Tuple[float, ...]] = None
    devices: Optional[Tuple[str, ...]] = None
    cores: Optional[int] = None
    intra_op_threads: Optional[int] = None
    load: Optional[float] = None
    layer_costs: Optional[Tuple[float, ...]] = None
    step_times: Optional[Tuple[float, ...]] = None
    cpu_busy: Optional[Tuple[float, ...]] = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``None`` fields left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepContext:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (newer writers may add some)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key, kind in (("balance", int), ("memory_peak", float), ("memory_limit", float),
                          ("devices", str), ("layer_costs", float), ("step_times", float),
                          ("cpu_busy", float)):
            if values.get(key) is not None:
                values[key] = tuple(kind(x) for x in values[key])
        for key in ("placement", "threads"):
            if values.get(key) is not None:
                values[key] = tuple(tuple(int(x) for x in row) for row in values[key])
        return cls(**values)

    def merged(self, other: Optional[StepContext]) -> StepContext:
        """This context with ``other``'s known fields taking precedence."""
        if other is None:
            return self
        return StepContext(**{**asdict(self), **other.to_dict()})


def load_trace(path: str | os.PathLike[str]) -> Tuple[Timeline, StepContext]:
    """Read a Chrome/Perfetto trace written by ``trace()`` (``Trace.write``) or
    ``render.write_chrome_trace``, also one merged with a ``torch.profiler`` trace.

    Raises :class:`TraceFileError` for a missing, truncated or foreign file."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as error:
        raise TraceFileError(f"cannot read {os.fspath(path)!r}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TraceFileError(f"{os.fspath(path)!r} is not complete JSON (truncated or not a "
                               f"trace): {error}") from None
    return timeline_from_chrome_trace(data, name=os.fspath(path))


def timeline_from_chrome_trace(data: Any, name: str = "the trace") -> Tuple[Timeline, StepContext]:
    """The fastpipe timeline and step context in Chrome trace JSON ``data``."""
    events = data.get("traceEvents") if isinstance(data, Mapping) else None
    if not isinstance(events, list):
        raise TraceFileError(f"{name} is not a Chrome/Perfetto trace (no 'traceEvents' list); "
                               f"write one with Trace.write(path) inside pipe.trace()")
    mine = [e for e in events if _is_action(e)]
    if not mine:
        raise TraceFileError(f"{name} holds no fastpipe actions; it comes from another tool or "
                               f"from an empty trace() block (run a train_step inside it)")
    other = data.get("otherData") if isinstance(data.get("otherData"), Mapping) else {}
    meta = other.get("fastpipe") if isinstance(other.get("fastpipe"), Mapping) else {}
    try:
        intervals = [(int(e["args"]["stage"]), _action(e["args"]), float(e["args"]["start"]),
                      float(e["args"]["end"])) for e in mine]
        stages = int(meta.get("num_stages", 1 + max(stage for stage, *_ in intervals)))
        unit = str(other.get("unit", mine[0]["args"].get("unit", "s")))
        timeline = Timeline.from_intervals(stages, intervals, source="measured", unit=unit)
        context = StepContext.from_dict(meta)
    except (TypeError, ValueError, KeyError) as error:
        raise TraceFileError(f"{name} has a malformed fastpipe event: {error}") from None
    if unit not in MICROSECONDS_PER_UNIT:
        raise TraceFileError(f"{name} is a {other.get('source', 'simulated')} timeline in "
                               f"{unit!r}; the doctor needs a measured one (pipe.trace())")
    return timeline, context


def merge_chrome_traces(ours: Mapping[str, Any], profiler: Mapping[str, Any]) -> dict[str, Any]:
    """One Chrome trace holding a ``torch.profiler`` trace and a fastpipe one (``chrome_trace``
    of a measured timeline): the fastpipe lanes become one more process, shifted onto the
    profiler's clock by the ``fastpipe/<action>`` ranges both hold (profile every thread:
    ``fastpipe.runtime.observe.profiler_ranges.profile()``). The fastpipe context stays under
    ``otherData.fastpipe``, so the doctor reads the merged file too."""
    theirs = profiler.get("traceEvents") if isinstance(profiler, Mapping) else None
    if not isinstance(theirs, list):
        raise TraceFileError("the profiler trace has no 'traceEvents' list; export it with "
                               "prof.export_chrome_trace(path)")
    mine = [e for e in ours["traceEvents"] if e.get("ph") == "X"]
    starts = {e["name"]: e["ts"] for e in mine}
    shifts = sorted(e["ts"] - starts[e["name"][len("fastpipe/"):]] for e in theirs
                    if isinstance(e, Mapping) and e.get("ph") == "X"
                    and str(e.get("name", "")).startswith("fastpipe/")
                    and e["name"][len("fastpipe/"):] in starts)
    if not shifts:
        raise TraceFileError("the profiler trace holds none of this step's fastpipe/ ranges: "
                               "profile the same step, with every thread recorded "
                               "(fastpipe.runtime.observe.profiler_ranges.profile())")
    shift, pid = shifts[len(shifts) // 2], _free_pid(theirs)
    moved = [{**e, "pid": pid, **({"ts": e["ts"] + shift} if "ts" in e else {})}
             for e in ours["traceEvents"]]
    other = {**profiler.get("otherData", {}), **ours.get("otherData", {})}
    return {**profiler, "traceEvents": [*theirs, *moved], "otherData": other}


def _free_pid(events: Sequence[Any]) -> int:
    pids = [e.get("pid") for e in events if isinstance(e, Mapping)]
    return 1 + max((p for p in pids if isinstance(p, int)), default=0)


def _is_action(event: Any) -> bool:
    args = event.get("args") if isinstance(event, Mapping) else None
    return (isinstance(args, Mapping) and event.get("ph") == "X"
            and all(key in args for key in _ACTION_ARGS))


def _action(args: Mapping[str, Any]) -> Action:
    return Action(int(args["stage"]), args["kind"], int(args["microbatch"]), int(args["chunk"]))


def check_timeline(timeline: Any) -> Timeline:
    """``timeline`` if the doctor can diagnose it: measured, two or more stages, not empty."""
    if not isinstance(timeline, Timeline):
        raise TraceFileError(f"expected a Timeline or a Trace from pipe.trace(), got "
                               f"{type(timeline).__name__}")
    if not timeline.events:
        raise TraceFileError("the timeline is empty: run a train_step inside pipe.trace()")
    if timeline.num_stages < 2:
        raise TraceFileError(f"the timeline has {timeline.num_stages} stage: there is no "
                               f"pipeline to diagnose (use two or more stages)")
    return timeline
