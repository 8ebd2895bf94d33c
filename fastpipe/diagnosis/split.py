"""Where a measured step's time went, per stage: compute and six kinds of waiting.

Each stage's share of the step is split into: **compute** (its F, B, W actions, recomputation
included); waiting on a neighbour because of the schedule's **inherent** bubble; waiting because
of stage **imbalance**; waiting on **communication** (from the moment its input was produced on
another stage until the stage started on it, and the waits that transfer latency passes on);
waiting on the **input** (from the step's start, the previous step's return, to the
``train_step`` call: data loading and the caller's work between steps); the **optimizer** (after
the last action until ``train_step`` returned); and **unexplained** gaps (idle with every input
ready: runtime overhead, the step's set-up before its first action, stages sharing a worker
thread, CPU contention, or delays passed on by other stages).

Waiting on neighbours is told apart by re-simulating the same schedule (its action order as
measured) with the simulator: with the measured mean cost of each action kind per virtual stage,
with those costs made equal across stages, and with the measured transfer latency added. A
stage's idle time in the equal-cost run is the schedule's own bubble; what the measured costs add
is imbalance; what the latency adds is communication. Pure Python: no torch.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.trace_file import StepContext, TraceFileError
from ..schedule import SCHEDULES
from ..schedule import Action, Schedule, ScheduleError
from ..schedule.recommend import make_schedule
from ..schedule.simulator import Costs, simulate
from ..schedule.timeline import Event, Timeline

__all__ = ["CATEGORIES", "Split", "split_step", "measured_schedule", "measured_costs"]

CATEGORIES = ("compute", "inherent", "imbalance", "communication", "input", "optimizer",
              "unexplained")
"""The categories of a stage's step time, in report order."""


@dataclass(frozen=True)
class Split:
    """A step's time per stage and category (seconds), and what the split was computed from.

    ``seconds[s][c]``: stage ``s``'s time in category ``c``; each stage's row sums to
    ``step_time``. ``simulated``: the step's pipeline time re-simulated with the measured costs;
    ``equalized``: with the costs made equal across stages; ``pipeline_time``: measured, from the
    first action's start to the last one's end. ``dispatch_gaps``: the gaps between
    actions whose inputs were all ready (the runtime's per-action overhead).
    """

    schedule: Schedule
    costs: Costs
    step_time: float
    pipeline_time: float
    seconds: Tuple[Dict[str, float], ...]
    simulated: float
    equalized: float
    dispatch_gaps: Tuple[float, ...]

    def share(self, category: str, stage: Optional[int] = None) -> float:
        """Share of the step in ``category``: of one stage's time, or of all stages' time."""
        rows = self.seconds if stage is None else (self.seconds[stage],)
        total = self.step_time * len(rows)
        return sum(row[category] for row in rows) / total if total > 0 else 0.0


def split_step(timeline: Timeline, context: StepContext) -> Split:
    """Split the step of a measured ``timeline`` (see the module docstring)."""
    schedule = measured_schedule(timeline, context)
    costs = measured_costs(timeline, schedule)
    ends = {event.action: event.end for event in timeline.events}
    by_stage = timeline.by_stage()
    lanes = [_lane(timeline, schedule, ends, stage, lane, _mates(by_stage, stage, context))
             for stage, lane in enumerate(by_stage)]
    latencies = [x for _, _, found in lanes for x in found]
    latency = statistics.median(latencies) if latencies else 0.0
    simulated = simulate(schedule, costs).timeline
    equalized = simulate(schedule, equal_costs(costs)).timeline
    delayed = simulate(schedule, replace(costs, p2p=latency)).timeline if latency else simulated
    begin = timeline.start if context.step_start is None else min(context.step_start,
                                                                   timeline.start)
    finish = timeline.end if context.step_end is None else max(context.step_end, timeline.end)
    called = timeline.start if context.step_called is None else min(
        max(context.step_called, begin), timeline.start)
    for stage, (row, _, _) in enumerate(lanes):
        row["input"] = called - begin
        row["unexplained"] += timeline.start - called  # the step's own set-up
        row["optimizer"] = finish - timeline.end
        _attribute_waiting(row, _idle(equalized, stage), _idle(simulated, stage),
                           _idle(delayed, stage))
    return Split(schedule, costs, finish - begin, timeline.makespan,
                 tuple(row for row, _, _ in lanes), simulated.makespan, equalized.makespan,
                 tuple(x for _, gaps, _ in lanes for x in gaps))


def _idle(timeline: Timeline, stage: int) -> float:
    return timeline.makespan - timeline.busy[stage]


def _mates(lanes: Sequence[Sequence[Event]], stage: int,
           context: StepContext) -> List[Tuple[float, float]]:
    """The (start, end) of the actions of the stages sharing ``stage``'s worker thread."""
    group = next((g for g in context.threads or () if stage in g), (stage,))
    return sorted((e.start, e.end) for s in group if s != stage and s < len(lanes)
                  for e in lanes[s])


def _overlap(begin: float, end: float, spans: Sequence[Tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in spans if a < end and b > begin)


def _lane(timeline: Timeline, schedule: Schedule, ends: Dict[Action, float], stage: int,
          lane: Sequence[Event], mates: Sequence[Tuple[float, float]] = (),
          ) -> Tuple[Dict[str, float], List[float], List[float]]:
    """One stage's compute, waiting on neighbours, communication and unexplained seconds within
    the pipeline's span; its dispatch gaps (idle with the inputs ready) and its transfer
    latencies (from a remote input's production to the start of its consumer); ``ends``: when
    each action of the step ended; ``mates``: the actions of stages sharing its worker thread
    (their time is not the runtime's per-action overhead)."""
    row = dict.fromkeys(CATEGORIES, 0.0)
    row["waiting"] = 0.0
    gaps: List[float] = []
    latencies: List[float] = []
    previous = timeline.start
    for event in lane:
        row["compute"] += event.duration
        gap = max(0.0, event.start - previous)
        deps = [d for d in schedule.dependencies(event.action) if d in ends]
        ready = max((ends[d] for d in deps), default=timeline.start)
        waited = min(gap, max(0.0, ready - previous))
        row["waiting"] += waited
        if waited > 0 and any(d.stage != stage and ends[d] >= ready for d in deps):
            row["communication"] += gap - waited
            latencies.append(gap - waited)
        else:
            row["unexplained"] += gap - waited
            if event.start > timeline.start and ready <= previous:
                gaps.append(gap - _overlap(previous, event.start, mates))
        previous = max(previous, event.end)
    row["waiting"] += timeline.end - previous  # drained: the others are still working
    return row, gaps, latencies


def _attribute_waiting(row: Dict[str, float], idle_equal: float, idle_measured: float,
                       idle_delayed: float) -> None:
    """Split a stage's waiting on neighbours, in this order, into the schedule's inherent
    bubble (its idle time with equal costs), imbalance (what the measured costs add),
    communication (what the measured transfer latency adds: delays passed on by the stages it
    waits for) and the rest (unexplained)."""
    rest = row.pop("waiting")
    for category, bound in (("inherent", idle_equal),
                            ("imbalance", max(0.0, idle_measured - idle_equal)),
                            ("communication", max(0.0, idle_delayed - idle_measured))):
        share = min(rest, bound)
        row[category] += share
        rest -= share
    row["unexplained"] += rest


def measured_schedule(timeline: Timeline, context: StepContext) -> Schedule:
    """The schedule that ran: each stage's actions in the order they started (a generated
    schedule when ``context`` names one and its actions match, for its placement)."""
    rows = tuple(tuple(e.action for e in lane) for lane in timeline.by_stage())
    actions = [a for row in rows for a in row]
    microbatches = 1 + max(a.microbatch for a in actions)
    chunks = context.virtual_stages or 1 + max(a.chunk for a in actions)
    names = [context.schedule] if context.schedule in SCHEDULES else sorted(SCHEDULES)
    for name in names:
        generated = _generated(name, timeline.num_stages, microbatches, chunks)
        if generated is not None and _same_order(generated, rows):
            return generated
    try:
        return Schedule(context.schedule or "measured", timeline.num_stages, microbatches, rows,
                        chunks, context.placement)
    except (ScheduleError, ValueError, TypeError) as error:
        raise TraceFileError(f"the timeline's actions do not form a schedule: {error}") from None


def _generated(name: str, stages: int, microbatches: int, chunks: int) -> Optional[Schedule]:
    try:
        return make_schedule(name, stages, microbatches, chunks)
    except (ValueError, NotImplementedError):
        return None


def _same_order(schedule: Schedule, rows: Tuple[Tuple[Action, ...], ...]) -> bool:
    """Whether ``rows`` are ``schedule``'s actions (a forward pass: its forward actions)."""
    return schedule.actions == rows or schedule.forward_actions == rows


def measured_costs(timeline: Timeline, schedule: Schedule) -> Costs:
    """Mean measured seconds of F, B and W per virtual stage; a B without a W is the full
    backward (the simulator's ``backward + weight``), so its ``weight`` is 0."""
    spans: Dict[Tuple[str, int], List[float]] = defaultdict(list)
    for event in timeline.events:
        spans[(event.action.kind.value, schedule.virtual_stage_of(event.action))].append(
            event.duration)
    n = schedule.num_virtual_stages
    mean = [[_mean(spans[(kind, v)]) for v in range(n)] for kind in ("F", "B", "W")]
    return Costs(forward=mean[0], backward=mean[1], weight=mean[2])


def equal_costs(costs: Costs) -> Costs:
    """``costs`` with each kind's cost made the mean over virtual stages."""
    return Costs(**{name: _mean(list(_values(getattr(costs, name))))
                    for name in ("forward", "backward", "weight", "p2p")})


def _values(cost: float | Tuple[float, ...]) -> Tuple[float, ...]:
    return cost if isinstance(cost, tuple) else (cost,)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def stage_work(costs: Costs, schedule: Schedule) -> Tuple[float, ...]:
    """Per physical stage, its F + B + W cost per micro-batch, summed over its chunks."""
    n = schedule.num_virtual_stages
    per_virtual = [sum(values) for values in zip(*(costs.per_virtual_stage(name, n)
                                                   for name in ("forward", "backward", "weight")))]
    return tuple(sum(per_virtual[v] for v in row) for row in schedule.placement)
