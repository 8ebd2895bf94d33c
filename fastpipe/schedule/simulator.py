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
``backward + weight``. Work that differs between chunks (the embedding on the
first, the head and loss on the last) is a per-chunk cost like any other.

Per-step costs, beyond the actions (all 0 by default, and then the step is the
makespan): ``send`` keeps a stage busy after each action whose result goes to
another physical stage (a blocking send, so every chunk boundary a schedule
crosses costs its sender this much); ``reduction`` is a chunk's gradient
reduction, which starts when the chunk's last backward action ends (or up to
``reduction_lead`` earlier: gradients reduced bucket by bucket as that action
produces them, the reduction then ending no earlier than the action) and runs
on its stage's one communication channel, overlapping the stage's later compute;
``optimizer`` is a chunk's optimizer step, run once the stage's compute and
reductions are done. :attr:`SimulationResult.step_time` covers all of them.

The start times are the longest paths of a DAG, computed in one pass driven by
completions: a stage advances until its next action waits for an unfinished
dependency, and is woken when that dependency finishes. Work is
O(actions x dependencies). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields, replace
from itertools import repeat
from typing import Sequence, Union

from .actions import Action, F, W, gc_paused
from .checks import ScheduleError
from .ir import Group, ScheduleData
from .timeline import Event, Timeline

_new_object, _set = object.__new__, object.__setattr__  # events built without their checks

__all__ = ["CHECKPOINTED", "Costs", "SimulationResult", "activation_peaks",
           "checkpointed_count", "mode_peaks", "simulate"]

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
    (chunk, micro-batch) in flight. ``send``: time the producing stage stays busy
    sending an action's result to another physical stage; ``reduction``: the
    chunk's gradient reduction after its last backward; ``optimizer``: the
    chunk's optimizer step at the end of the step; ``reduction_lead``: how long
    before its last backward action ends a chunk's reduction may start (see the
    module docstring). Each is a number or a sequence with one entry per virtual
    stage.
    """

    forward: Cost = 1.0
    backward: Cost = 1.0
    weight: Cost = 1.0
    p2p: Cost = 0.0
    activation: Cost = 1.0
    send: Cost = 0.0
    reduction: Cost = 0.0
    optimizer: Cost = 0.0
    reduction_lead: Cost = 0.0

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
    (``Costs.activation`` summed over the (chunk, micro-batch) pairs in flight) and, per
    stage, when its step ends (``stage_end``: its actions, its gradient reductions and its
    optimizer step; empty when every per-step cost is 0)."""

    schedule: ScheduleData
    costs: Costs
    timeline: Timeline
    peak_memory: tuple[float, ...]
    stage_end: tuple[float, ...] = ()

    @property
    def makespan(self) -> float:
        """Simulated time from the first start to the last end."""
        return self.timeline.makespan

    @property
    def step_time(self) -> float:
        """The whole step: the makespan, plus the reductions and optimizer steps that end
        after the last action (equal to :attr:`makespan` without per-step costs)."""
        if not self.stage_end:
            return self.makespan
        return max(self.makespan, max(self.stage_end) - self.timeline.start)

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


def simulate(schedule: ScheduleData, costs: Costs | None = None,
             **overrides: Cost) -> SimulationResult:
    """Simulate ``schedule`` under ``costs`` (default :class:`Costs`; keyword ``overrides``
    replace its fields) and return the timed result.

    Raises :class:`ScheduleError` naming the blocked actions when no stage can
    proceed (a deadlock, or a dependency that is not in the schedule).
    """
    costs = replace(costs or Costs(), **overrides) if overrides else (costs or Costs())
    activation = costs.per_virtual_stage("activation", schedule.num_virtual_stages)
    with gc_paused():
        timeline = Timeline(schedule.num_stages, _events(schedule, costs), "simulated", "units")
        memory = _peak_memory(schedule, activation, timeline)
        ends = _stage_ends(schedule, costs, timeline)
    return SimulationResult(schedule, costs, timeline, memory, ends)


def _events(schedule: ScheduleData, costs: Costs) -> tuple[Event, ...]:
    """When each action runs: one event per action, stage by stage (the working data goes
    on return, while the collector is still paused)."""
    graph = _Graph(schedule)
    starts, ends = _run(schedule, graph, *_cost_arrays(schedule, costs, graph))
    return tuple(map(_event, graph.stage_of, graph.actions, starts, ends))


def _stage_ends(schedule: ScheduleData, costs: Costs, timeline: Timeline) -> tuple[float, ...]:
    """Per stage, when its step ends: each chunk's reduction starts when the chunk's last
    backward action ends (less its ``reduction_lead``, but not before that action starts),
    one at a time on the stage's channel; the stage's step ends after its last action and
    its last reduction, then the optimizer steps. Empty when there is neither reduction nor
    optimizer cost."""
    n = schedule.num_virtual_stages
    reduction, optimizer, lead = (costs.per_virtual_stage(name, n) for name in
                                  ("reduction", "optimizer", "reduction_lead"))
    if not any(reduction) and not any(optimizer):
        return ()
    last: dict[int, Event] = {}
    where = schedule.placement
    for event in timeline.events:
        if event.action.kind is not F:
            vs = where[event.stage][event.action.chunk]
            if vs not in last or event.end > last[vs].end:
                last[vs] = event
    ends = []
    for stage, lane in enumerate(timeline.by_stage()):
        done = lane[-1].end if lane else timeline.start
        channel = timeline.start
        for vs in sorted(where[stage], key=lambda v: last[v].end if v in last else done):
            final = last.get(vs)
            ready = done if final is None else max(final.start, final.end - lead[vs])
            channel = max(channel, ready) + reduction[vs]
        ends.append(max(done, channel) + sum(optimizer[vs] for vs in where[stage]))
    return tuple(ends)


def _event(stage: int, action: Action, start: float, end: float) -> Event:
    """``Event(stage, action, start, end)`` without ``__init__``: the simulator makes one per
    action, from values it computed."""
    event = _new_object(Event)
    _set(event, "stage", stage)
    _set(event, "action", action)
    _set(event, "start", start)
    _set(event, "end", end)
    return event


def _peak_memory(
    schedule: ScheduleData, activation: tuple[float, ...], timeline: Timeline
) -> tuple[float, ...]:
    """Per stage, the most activation memory in flight (from the peak count when uniform)."""
    if len(set(activation)) == 1:
        return tuple(activation[0] * peak for peak in timeline.peak_inflight)
    return activation_peaks(schedule, activation)


CHECKPOINTED = {"never": 0, "offload": 0, "selective": 0, "always": None, "except_last": -1}
"""Checkpoint mode -> how many of the first micro-batches recompute their forward in backward
(``None``: all of them; ``-1``: all but the last), as the step runtime applies the modes."""


def checkpointed_count(mode: str, num_microbatches: int) -> int:
    """How many micro-batches (the first ones) checkpoint ``mode`` recomputes."""
    if mode not in CHECKPOINTED:
        raise ValueError(f"checkpoint={mode!r} is not a checkpoint mode; use one of "
                         f"{', '.join(CHECKPOINTED)}")
    stop = CHECKPOINTED[mode]
    if stop is None:
        return num_microbatches
    return max(0, num_microbatches + stop) if stop < 0 else stop


def mode_peaks(schedule: ScheduleData, mode: str) -> tuple[float, ...]:
    """Per stage, the peak of :func:`activation_peaks` with one unit per (chunk, micro-batch)
    under checkpoint ``mode``: ratios between modes scale a measured peak to another mode."""
    return activation_peaks(schedule, [1.0] * schedule.num_virtual_stages,
                            checkpointed=checkpointed_count(mode, schedule.num_microbatches))


def activation_peaks(
    schedule: ScheduleData, held: Sequence[float] | Sequence[Sequence[float]], *,
    shared: Sequence[float] | None = None, checkpointed: int = 0,
) -> tuple[float, ...]:
    """Per physical stage, the most activation bytes held at once, scanning its actions in
    order (memory changes only with a stage's own actions, so no timing is needed).

    ``held[v]`` (or ``held[v][mb]``): what virtual stage ``v``'s forward keeps for backward per
    micro-batch; ``shared[v]``: bytes held once while any micro-batch of ``v`` holds its own
    (storages every micro-batch shares, e.g. views of the caller's batch). The first
    ``checkpointed`` micro-batches keep nothing from their ``F`` (their input is kept outside
    autograd, not counted) and hold their recomputed activations from their ``B``. A pair is
    released by its ``W`` when it has one (``B`` retains the graph for it), else by its ``B``.
    """
    n = schedule.num_virtual_stages
    size = [[float(h)] * schedule.num_microbatches if not isinstance(h, Sequence)
            else [float(x) for x in h] for h in held]
    if len(size) != n:
        raise ValueError(f"held has {len(size)} entries but the schedule has {n} virtual "
                         f"stages; give one per virtual stage")
    once = [float(x) for x in shared] if shared is not None else [0.0] * n
    return tuple(_lane_peak(row, schedule.placement[s], size, once, checkpointed)
                 for s, row in enumerate(schedule.actions))


def _lane_peak(row: Sequence[Action], place: Sequence[int], size: list[list[float]],
               once: list[float], checkpointed: int) -> float:
    """The peak of one stage's actions: a pair's bytes come with its ``F`` (its ``B`` when
    recomputed) and go with its last backward action."""
    split = {(a.chunk, a.microbatch) for a in row if a.kind is W}
    live: dict[tuple[int, int], float] = {}
    holders: dict[int, int] = {}
    total = peak = 0.0
    for a in row:
        key, v = (a.chunk, a.microbatch), place[a.chunk]
        if (a.kind is F) != (a.microbatch < checkpointed) and key not in live:
            live[key] = size[v][a.microbatch]
            holders[v] = holders.get(v, 0) + 1
            total += live[key] + (once[v] if holders[v] == 1 else 0.0)
            peak = max(peak, total)
        if a.kind is not F and (a.kind is W) == (key in split) and key in live:
            holders[v] -= 1
            total -= live.pop(key) + (once[v] if holders[v] == 0 else 0.0)
    return peak


class _Graph:
    """The schedule's actions numbered stage by stage, with their dependencies as numbers.

    ``deps[i]`` lists the numbers of the actions ``actions[i]`` depends on, per
    :meth:`Schedule.dependencies`; a dependency missing from the schedule gets
    ``len(actions)``, which never finishes.
    """

    def __init__(self, schedule: ScheduleData) -> None:
        self.actions = [a for row in schedule.actions for a in row]
        self.stage_of = [s for s, row in enumerate(schedule.actions) for _ in row]
        self.offsets = [0]
        for row in schedule.actions:
            self.offsets.append(self.offsets[-1] + len(row))
        self.deps = _dependency_numbers(schedule, self.actions, self.offsets)


def _dependency_numbers(
    schedule: ScheduleData, actions: list[Action], offsets: list[int]
) -> list[tuple[int, ...]]:
    """:meth:`Schedule.dependencies` of every action, as action numbers: in bulk for each
    (stage, kind, chunk) group (:meth:`Schedule.dependency_groups`), else action by action."""
    missing = len(actions)
    positions = schedule.positions_by_group
    number = {  # group -> micro-batch -> number of the action (the last, where one repeats)
        group: {mb: offsets[group[0]] + i for mb, i in mine.items()}
        for group, mine in positions.items()
    }
    if sum(map(len, positions.values())) != len(actions):  # repeated actions
        return [_numbers(schedule, a, number, missing) for a in actions]
    deps: list[tuple[int, ...]] = [()] * len(actions)
    for group, mine in number.items():
        targets = schedule.dependency_groups(*group)
        if targets is None:
            for i in mine.values():
                deps[i] = _numbers(schedule, actions[i], number, missing)
            continue
        columns = [list(map(number.get(t, {}).get, mine, repeat(missing))) for t in targets]
        for i, row in zip(mine.values(), zip(*columns) if columns else repeat(())):
            deps[i] = row
    return deps


def _numbers(
    schedule: ScheduleData, action: Action, number: dict[Group, dict[int, int]], missing: int
) -> tuple[int, ...]:
    """The numbers of ``action``'s dependencies, asked of :meth:`Schedule.dependencies`."""
    return tuple(
        number.get((d.stage, d.kind, d.chunk), {}).get(d.microbatch, missing)
        for d in schedule.dependencies(action)
    )


def _cost_arrays(
    schedule: ScheduleData, costs: Costs, graph: _Graph
) -> tuple[list[float], list[float]]:
    """Per action: its duration (a blocking send to another stage included), and the latency
    of sending its result to another stage."""
    n = schedule.num_virtual_stages
    forward, backward, weight, p2p, send = (
        costs.per_virtual_stage(name, n)
        for name in ("forward", "backward", "weight", "p2p", "send")
    )
    split = {group[::2]: mbs for group, mbs in schedule.actions_by_group.items() if group[1] is W}
    where = schedule.placement
    durations, latencies = [], []
    for a in graph.actions:
        vs = where[a.stage][a.chunk]
        if a.kind is F:
            durations.append(forward[vs])
        elif a.kind is W:
            durations.append(weight[vs])
        elif a.microbatch in split.get((a.stage, a.chunk), ()):
            durations.append(backward[vs])
        else:
            durations.append(backward[vs] + weight[vs])
        latencies.append(p2p[vs])
    if any(send):
        for i in _sent(graph):
            durations[i] += send[where[graph.stage_of[i]][graph.actions[i].chunk]]
    return durations, latencies


def _sent(graph: _Graph) -> set[int]:
    """The actions whose result another physical stage depends on (each sent once)."""
    stage_of, missing = graph.stage_of, len(graph.actions)
    return {d for i, deps in enumerate(graph.deps) for d in deps
            if d != missing and stage_of[d] != stage_of[i]}


def _run(
    schedule: ScheduleData, graph: _Graph, durations: list[float], latencies: list[float]
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
        i, t, stop = heads[stage], clock[stage], stops[stage]
        while i < stop:
            start = t
            for d in deps[i]:
                done = ends[d]
                if done is None:
                    break  # not finished: wait for it
                if stage_of[d] != stage:
                    done += latencies[d]
                if done > start:
                    start = done
            else:  # every dependency finished
                starts[i] = start
                t = ends[i] = start + durations[i]
                woken = waiting.pop(i, None)
                if woken:
                    ready.extend(woken)
                i += 1
                continue
            waiting.setdefault(d, []).append(stage)
            break
        heads[stage], clock[stage] = i, t
    if heads != stops:
        raise ScheduleError(_deadlock_message(schedule, graph, heads, ends))
    return starts, ends[:n]


def _deadlock_message(
    schedule: ScheduleData, graph: _Graph, heads: list[int], ends: list[float | None]
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
