"""Schedule validation: completeness, per-stage order, and deadlock freedom.

:func:`validate` checks that every action is in range, that every (virtual stage,
micro-batch) has its F and B once (and W at most once), that a stage runs no action before a
dependency on the same stage, and that the schedule's lowered programs do not deadlock under a
transport's semantics: the lock-step simulation of :mod:`fastpipe.schedule.lockstep`, whose
docstring describes the models (``"rendezvous"``, ``"buffered"``, ``"nccl"``). Under
``comm="nccl"`` it checks :func:`fastpipe.schedule.nccl.lower_nccl`'s programs, the ones
``DistributedPipe(p2p="grouped")`` runs; else :func:`~fastpipe.schedule.lower.lower`'s.

Cross-stage data dependencies (``F`` after the previous virtual stage's ``F``,
``B`` after the next virtual stage's ``B``) are enforced by the receives, so
the simulation also checks them; dependencies between actions on the same
stage are checked directly against the stage's order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import attrgetter, gt
from typing import Sequence

from .actions import Action, ActionKind, gc_paused
from .checks import ScheduleError
from .ir import ScheduleData
from .lockstep import COMM_MODELS, check_comm, lockstep_rounds, run_lockstep
from .lower import SkipLink, lower_fields
from .nccl import nccl_fields

__all__ = [
    "COMM_MODELS",
    "ScheduleError",
    "ValidationReport",
    "lockstep_rounds",
    "peak_inflight",
    "run_lockstep",
    "validate",
]


@dataclass(frozen=True)
class ValidationReport:
    """What validation learned about a schedule that passed.

    ``peak_inflight[s]``: most (chunk, micro-batch) pairs forwarded but not yet
    backwarded on stage ``s`` at any time. ``num_steps``: lock-step rounds of the
    simulation (the makespan with unit-time compute and free communication).
    ``action_steps[s][i]``: the round in which stage ``s`` ran its ``i``-th action.
    """

    peak_inflight: tuple[int, ...]
    num_steps: int
    action_steps: tuple[tuple[int, ...], ...]

    @property
    def busy_steps(self) -> tuple[int, ...]:
        """Compute rounds per stage."""
        return tuple(len(steps) for steps in self.action_steps)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-rounds spent idle under unit-time compute."""
        total = self.num_steps * len(self.action_steps)
        return 1.0 - sum(self.busy_steps) / total if total else 0.0


def validate(schedule: ScheduleData, *, comm: str = "rendezvous",
             skips: Sequence[SkipLink] = ()) -> ValidationReport:
    """Check ``schedule`` and report its peak in-flight micro-batches and length.

    Raises :class:`ScheduleError` naming the stage, action and problem when an
    action is out of range, a (virtual stage, micro-batch) lacks or repeats its
    F or B (or repeats W), a stage runs an action before a same-stage dependency,
    or the lowered programs deadlock under the ``comm`` model (one of
    :data:`COMM_MODELS`). ``skips``: the model's skip connections, whose transfers the
    programs include too. Under ``"nccl"`` the programs are NCCL's (``lower_nccl``), else
    :func:`~fastpipe.schedule.lower.lower`'s.
    """
    check_comm(comm)
    with gc_paused():
        _check_ranges(schedule)
        _check_complete(schedule)
        _check_local_order(schedule)
        # lower() without building the op objects; temporaries go before the collector resumes
        programs = (nccl_fields(schedule, skips=skips) if comm == "nccl"
                    else lower_fields(schedule, skips=skips))
        steps = lockstep_rounds(schedule, programs, comm=comm)
        return ValidationReport(peak_inflight(schedule), max(_last_steps(steps)), steps)


_DELTA = {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1, ActionKind.WEIGHT: 0}
_kind = attrgetter("kind")
_microbatch = attrgetter("microbatch")
_chunk = attrgetter("chunk")


def peak_inflight(schedule: ScheduleData) -> tuple[int, ...]:
    """Per stage, the most (chunk, micro-batch) pairs forwarded but not yet backwarded."""
    return tuple(
        max(0, max(accumulate(map(_DELTA.__getitem__, map(_kind, row))), default=0))
        for row in schedule.actions
    )


def _last_steps(steps: tuple[tuple[int, ...], ...]) -> list[int]:
    return [row[-1] + 1 if row else 0 for row in steps]


# -- structural checks -------------------------------------------------------


def _check_ranges(schedule: ScheduleData) -> None:
    m, v = schedule.num_microbatches, schedule.num_chunks
    for stage, row in enumerate(schedule.actions):
        if max(map(_microbatch, row), default=0) < m and max(map(_chunk, row), default=0) < v:
            continue  # every action in range, checked at C speed
        for position, action in enumerate(row):
            where = f"stage {stage}: action {action} at position {position}"
            if action.microbatch >= m:
                raise ScheduleError(
                    f"{where} refers to micro-batch {action.microbatch}, but the schedule "
                    f"has num_microbatches={m} (valid 0..{m - 1})"
                )
            if action.chunk >= v:
                raise ScheduleError(
                    f"{where} refers to chunk {action.chunk}, but the schedule "
                    f"has num_chunks={v} (valid 0..{v - 1})"
                )


def _check_complete(schedule: ScheduleData) -> None:
    sizes = _group_sizes(schedule)
    m = schedule.num_microbatches
    for stage, row in enumerate(schedule.actions):
        mine = sizes[stage]
        expected = ((kind, chunk) for chunk in range(schedule.num_chunks)
                    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD))
        if sum(mine.values()) == len(row) and all(mine.get(key) == m for key in expected):
            continue  # no repeats, and every F and B present (all are in range)
        _report_incomplete(schedule, stage, row)


def _group_sizes(schedule: ScheduleData) -> list[dict[tuple[ActionKind, int], int]]:
    """Per stage, the number of distinct micro-batches of each (kind, chunk)."""
    sizes: list[dict[tuple[ActionKind, int], int]] = [{} for _ in schedule.actions]
    for (stage, kind, chunk), actions in schedule.actions_by_group.items():
        sizes[stage][kind, chunk] = len(actions)
    return sizes


def _report_incomplete(schedule: ScheduleData, stage: int, row: tuple[Action, ...]) -> None:
    counts = Counter(row)
    for action, count in counts.items():
        if count > 1:
            positions = [i for i, a in enumerate(row) if a == action]
            raise ScheduleError(
                f"stage {stage}: action {action} (micro-batch {action.microbatch}) "
                f"appears {count} times, at positions {positions}; it must run once"
            )
    for chunk in range(schedule.num_chunks):
        vs = schedule.virtual_stage(stage, chunk)
        for mb in range(schedule.num_microbatches):
            for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                expected = Action(stage, kind, mb, chunk)
                if expected not in counts:
                    raise ScheduleError(
                        f"stage {stage}: micro-batch {mb} of chunk {chunk} (virtual "
                        f"stage {vs}) has no {kind.name.lower()}; expected action "
                        f"{expected} in stage {stage}'s row"
                    )


def _check_local_order(schedule: ScheduleData) -> None:
    for stage, row in enumerate(schedule.actions):
        if not _locally_ordered(schedule, stage):
            _report_local_order(schedule, stage, row)


def _locally_ordered(schedule: ScheduleData, stage: int) -> bool:
    """Whether every action of ``stage`` follows its dependencies on the same stage, compared
    group by group (each action appears once by now); ``False`` also when undecided."""
    positions = schedule.positions_by_group
    for key, mine in positions.items():
        if key[0] != stage:
            continue
        deps = schedule.dependency_groups(*key)
        if deps is None:
            return False  # dependencies differ by micro-batch: check action by action
        for dep in deps:
            if dep[0] == stage and _runs_first(mine, positions.get(dep, {})):
                return False
    return True


def _runs_first(mine: dict[int, int], theirs: dict[int, int]) -> bool:
    """Whether an action at ``mine[k]`` comes before the one at ``theirs[k]``, for some ``k``."""
    return any(map(gt, map(theirs.get, mine, repeat(-1)), mine.values()))


def _report_local_order(schedule: ScheduleData, stage: int, row: tuple[Action, ...]) -> None:
    position = {action: i for i, action in enumerate(row)}
    for i, action in enumerate(row):
        for dep in schedule.dependencies(action):
            if dep.stage == stage and position[dep] > i:
                raise ScheduleError(
                    f"stage {stage}: action {action} (micro-batch {action.microbatch}) "
                    f"at position {i} runs before {dep} at position {position[dep]}, "
                    f"which it depends on ({_why(action, dep)})"
                )


def _why(action: Action, dep: Action) -> str:
    if action.kind is ActionKind.WEIGHT:
        return "a weight-gradient step must follow its backward"
    if dep.kind is ActionKind.FORWARD and action.kind is ActionKind.BACKWARD:
        return "a backward must follow its forward"
    if dep.kind is ActionKind.FORWARD:
        return "a forward needs the previous virtual stage's activation"
    return "a backward needs the next virtual stage's gradient"
