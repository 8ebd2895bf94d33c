"""Timed simulation of a schedule: when would each action run, given its cost?

Model. Each physical stage runs its actions in schedule order, one at a time.
An action starts at the latest of its stage's previous end and, for each
dependency (:meth:`Schedule.dependencies`, the same relation the validator
uses), that dependency's end, plus ``p2p`` when the dependency ran on another
physical stage. Transfers are buffered: a sender never waits for its receiver
(the validator's default rendezvous model is stricter), so a schedule that
validates also simulates.

Costs are per virtual stage (chunk). When the schedule has a ``W`` for a
(virtual stage, micro-batch), its ``B`` costs ``backward`` (input gradient) and
the ``W`` costs ``weight``; otherwise ``B`` is the full backward and costs
``backward + weight``.

The start times are the longest paths of a DAG, computed in one pass driven by
completions: a stage advances until its next action waits for an unfinished
dependency, and is woken when that dependency finishes. Work is
O(actions x dependencies). Pure Python: no torch.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Iterator, Sequence, Union

from .ir import Action, ActionKind, Schedule, ScheduleError
from .timeline import Event, Timeline

__all__ = ["Costs", "SimulationResult", "simulate"]

Cost = Union[float, Sequence[float]]
"""A cost: one number for every virtual stage, or one per virtual stage."""

_COSTS_FORM = "'F,B,W' or 'F,B,W,P2P' (non-negative numbers), e.g. '1,2,1' or '1,1,1,0.1'"


@dataclass(frozen=True)
class Costs:
    """Time of each action kind, and activation memory, per virtual stage (chunk).

    ``forward``/``backward``/``weight``: cost of ``F``, of the input-gradient part
    of ``B``, and of the weight-gradient part (``W``, or folded into ``B``).
    ``p2p``: latency added when a dependency ran on another physical stage
    (indexed by the producing virtual stage). ``activation``: memory held per
    (chunk, micro-batch) in flight. Each is a number or a sequence with one
    entry per virtual stage.
    """

    forward: Cost = 1.0
    backward: Cost = 1.0
    weight: Cost = 1.0
    p2p: Cost = 0.0
    activation: Cost = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name)))

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"F,B,W"`` or ``"F,B,W,P2P"``, as given on the command line."""
        parts = text.split(",") if isinstance(text, str) else []
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(values) not in (3, 4):
            raise ValueError(f"cannot parse costs {text!r}: expected {_COSTS_FORM}")
        try:
            return cls(*values)
        except ValueError as exc:
            raise ValueError(f"cannot parse costs {text!r}: {exc}") from None

    @property
    def is_uniform(self) -> bool:
        """True when every field is a single number (the same for every chunk)."""
        return all(not isinstance(getattr(self, f.name), tuple) for f in fields(self))

    def per_virtual_stage(self, name: str, num_virtual_stages: int) -> tuple[float, ...]:
        """Field ``name`` expanded to one value per virtual stage."""
        value = getattr(self, name)
        if not isinstance(value, tuple):
            return (value,) * num_virtual_stages
        if len(value) != num_virtual_stages:
            raise ValueError(
                f"costs.{name} has {len(value)} entries but the schedule has "
                f"{num_virtual_stages} virtual stages; give one number or one per virtual stage"
            )
        return value


def _checked(name: str, value: object) -> float | tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(name, value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_number(f"{name}[{i}]", v) for i, v in enumerate(value))
    raise TypeError(f"costs.{name} must be a number or a sequence of numbers, got {value!r}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"costs.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"costs.{name} must be a finite number >= 0, got {value}")
    return float(value)


@dataclass(frozen=True)
class SimulationResult:
    """A simulated run: its :class:`Timeline` plus the per-stage peak activation memory
    (``Costs.activation`` summed over the (chunk, micro-batch) pairs in flight)."""

    schedule: Schedule
    costs: Costs
    timeline: Timeline
    peak_memory: tuple[float, ...]

    @property
    def makespan(self) -> float:
        """Simulated time from the first start to the last end."""
        return self.timeline.makespan

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle."""
        return self.timeline.bubble_fraction

    @property
    def peak_inflight(self) -> tuple[int, ...]:
        """Per stage, the most (chunk, micro-batch) pairs in flight (see :class:`Timeline`)."""
        return self.timeline.peak_inflight

    @property
    def busy(self) -> tuple[float, ...]:
        """Per stage, the time spent computing."""
        return self.timeline.busy


def simulate(schedule: Schedule, costs: Costs | None = None, **overrides: Cost) -> SimulationResult:
    """Simulate ``schedule`` under ``costs`` (default :class:`Costs`; keyword ``overrides``
    replace its fields) and return the timed result.

    Raises :class:`ScheduleError` naming the blocked actions when no stage can
    proceed (a deadlock, or a dependency that is not in the schedule).
    """
    costs = replace(costs or Costs(), **overrides) if overrides else (costs or Costs())
    activation = costs.per_virtual_stage("activation", schedule.num_virtual_stages)
    with _gc_paused():
        graph = _Graph(schedule)
        starts, ends = _run(schedule, graph, *_cost_arrays(schedule, costs, graph))
        events = tuple(map(Event, graph.stage_of, graph.actions, starts, ends))
        timeline = Timeline(schedule.num_stages, events, "simulated", "units")
        memory = _peak_memory(schedule, activation, timeline)
    return SimulationResult(schedule, costs, timeline, memory)


def _peak_memory(
    schedule: Schedule, activation: tuple[float, ...], timeline: Timeline
) -> tuple[float, ...]:
    """Per stage, the most activation memory in flight (from the peak count when uniform)."""
    if len(set(activation)) == 1:
        return tuple(activation[0] * peak for peak in timeline.peak_inflight)
    where = schedule.placement
    return timeline.peak_weighted(lambda a: activation[where[a.stage][a.chunk]])


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small acyclic objects:
    its generation scans would otherwise dominate the run time of large schedules."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Graph:
    """The schedule's actions numbered stage by stage, with their dependencies as numbers.

    ``deps[i]`` lists the numbers of the actions ``actions[i]`` depends on, per
    :meth:`Schedule.dependencies`; a dependency missing from the schedule gets
    ``len(actions)``, which never finishes.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.actions = [a for row in schedule.actions for a in row]
        self.stage_of = [s for s, row in enumerate(schedule.actions) for _ in row]
        self.offsets = [0]
        for row in schedule.actions:
            self.offsets.append(self.offsets[-1] + len(row))
        self.deps = _dependency_numbers(schedule, self.actions)


_Group = tuple[int, ActionKind, int]
"""Actions that differ only in micro-batch: ``(stage, kind, chunk)``."""


def _dependency_numbers(schedule: Schedule, actions: list[Action]) -> list[tuple[int, ...]]:
    """:meth:`Schedule.dependencies` of every action, as action numbers, asked once per group.

    The IR's dependencies of micro-batch ``k`` are those of micro-batch 0 with
    ``k`` substituted; that is checked on the first and last micro-batch, and a
    group where it fails is asked action by action instead.
    """
    groups: dict[_Group, list[int]] = {}
    for i, a in enumerate(actions):
        groups.setdefault((a.stage, a.kind, a.chunk), []).append(i)
    number = {group: {actions[i].microbatch: i for i in ids} for group, ids in groups.items()}
    missing = len(actions)
    deps: list[tuple[int, ...]] = [()] * len(actions)
    for group, ids in groups.items():
        template = _template(schedule, group)
        if template is None:
            for i in ids:
                deps[i] = tuple(
                    number.get((d.stage, d.kind, d.chunk), {}).get(d.microbatch, missing)
                    for d in schedule.dependencies(actions[i])
                )
            continue
        mbs = [actions[i].microbatch for i in ids]
        columns = [[number.get(target, {}).get(mb, missing) for mb in mbs] for target in template]
        for i, row in zip(ids, zip(*columns) if columns else [()] * len(ids)):
            deps[i] = row
    return deps


def _template(schedule: Schedule, group: _Group) -> tuple[_Group, ...] | None:
    """The groups a group's actions depend on, if the same for every micro-batch."""
    shapes = {_shape(schedule, group, 0), _shape(schedule, group, schedule.num_microbatches - 1)}
    return shapes.pop() if len(shapes) == 1 else None


def _shape(schedule: Schedule, group: _Group, mb: int) -> tuple[_Group, ...] | None:
    """Groups of the dependencies of ``group``'s micro-batch ``mb``; ``None`` if one of
    them is on another micro-batch."""
    stage, kind, chunk = group
    deps = schedule.dependencies(Action(stage, kind, mb, chunk))
    if any(d.microbatch != mb for d in deps):
        return None
    return tuple((d.stage, d.kind, d.chunk) for d in deps)


def _cost_arrays(
    schedule: Schedule, costs: Costs, graph: _Graph
) -> tuple[list[float], list[float]]:
    """Per action: its duration, and the latency of sending its result to another stage."""
    n = schedule.num_virtual_stages
    forward, backward, weight, p2p = (
        costs.per_virtual_stage(name, n) for name in ("forward", "backward", "weight", "p2p")
    )
    split = {(a.stage, a.chunk, a.microbatch) for a in graph.actions if a.kind is ActionKind.WEIGHT}
    where = schedule.placement
    durations, latencies = [], []
    for a in graph.actions:
        vs = where[a.stage][a.chunk]
        if a.kind is ActionKind.FORWARD:
            durations.append(forward[vs])
        elif a.kind is ActionKind.WEIGHT:
            durations.append(weight[vs])
        elif (a.stage, a.chunk, a.microbatch) in split:
            durations.append(backward[vs])
        else:
            durations.append(backward[vs] + weight[vs])
        latencies.append(p2p[vs])
    return durations, latencies


def _run(
    schedule: Schedule, graph: _Graph, durations: list[float], latencies: list[float]
) -> tuple[list[float], list[float]]:
    """Start and end of every action: advance each stage while its next action's
    dependencies have finished; when one has not, wait for it to wake the stage."""
    n, stage_of, deps = len(graph.actions), graph.stage_of, graph.deps
    starts = [0.0] * n
    ends: list[float | None] = [None] * (n + 1)
    heads, stops = graph.offsets[:-1], graph.offsets[1:]
    clock = [0.0] * schedule.num_stages
    waiting: dict[int, list[int]] = {}
    ready = deque(range(schedule.num_stages))
    while ready:
        stage = ready.popleft()
        i, t = heads[stage], clock[stage]
        while i < stops[stage]:
            start, blocker = t, None
            for d in deps[i]:
                done = ends[d]
                if done is None:
                    blocker = d
                    break
                if stage_of[d] != stage:
                    done += latencies[d]
                if done > start:
                    start = done
            if blocker is not None:
                waiting.setdefault(blocker, []).append(stage)
                break
            starts[i] = start
            t = ends[i] = start + durations[i]
            ready.extend(waiting.pop(i, ()))
            i += 1
        heads[stage], clock[stage] = i, t
    if heads != stops:
        raise ScheduleError(_deadlock_message(schedule, graph, heads, ends))
    return starts, ends[:n]


def _deadlock_message(
    schedule: Schedule, graph: _Graph, heads: list[int], ends: list[float | None]
) -> str:
    finished = {graph.actions[i] for i, end in enumerate(ends[:-1]) if end is not None}
    present = set(graph.actions)
    lines = [f"schedule {schedule.name!r} cannot proceed; blocked actions:"]
    for stage, head in enumerate(heads):
        if head >= graph.offsets[stage + 1]:
            continue
        action = graph.actions[head]
        missing = [d for d in schedule.dependencies(action) if d not in finished]
        why = "; ".join(
            f"waits for {d}" + ("" if d in present else " (not in the schedule)") for d in missing
        )
        position = head - graph.offsets[stage]
        lines.append(f"  stage {stage}: {action} at position {position} {why}")
    return "\n".join(lines)
