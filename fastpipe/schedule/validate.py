"""Schedule validation: completeness, per-stage order, and deadlock freedom.

Deadlock model. Every stage runs its lowered program (:func:`lower`) in order,
in lock-step rounds. A compute op runs when reached and takes one round. A
communication group is posted when reached; each op in it completes once the
peer stage has posted the matching counterpart (``send act k`` from ``s`` to
``s'`` <-> ``recv act k`` on ``s'`` from ``s``), and the stage moves on when
every op of its group has completed. Sends are not buffered (rendezvous), so a
send whose receiver is itself waiting on something else blocks the sender:
ordering mistakes surface as deadlocks instead of being hidden by buffering.
Classic 1F1B is deadlock-free here only because its steady-state
send-forward/receive-backward pairs are batched into one group.

``comm="nccl"`` models NCCL (:mod:`fastpipe.schedule.nccl_model`): a CPU that enqueues groups
without waiting and one FIFO stream per rank on which a group is one operation, sends that
complete only with their receives, and the ops between two ranks paired in posting order (NCCL
has no tags). :func:`validate` checks :func:`fastpipe.schedule.nccl.lower_nccl`'s programs under
it, the ones ``DistributedPipe(p2p="grouped")`` runs.

``comm="buffered"`` models mailbox hand-over instead, as the local executor
does: a send completes as soon as it is posted and its tensor waits in the
receiver's mailbox; a receive completes once its matching send was posted. A
schedule is then deadlock-free exactly when its per-stage orders and its data
dependencies admit a common order, whatever the send ordering.

Cross-stage data dependencies (``F`` after the previous virtual stage's ``F``,
``B`` after the next virtual stage's ``B``) are enforced by the receives, so
the simulation also checks them; dependencies between actions on the same
stage are checked directly against the stage's order.

The simulation is driven by events: it looks at a stage only when the stage reached a new
op or a peer completed its group, so it costs what the ops cost, not rounds x stages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import attrgetter, gt
from typing import Sequence, Union

from .nccl_model import NcclModel
from .ir import ANALYSES, Action, ActionKind, Schedule, ScheduleError, gc_paused
from .lower import (
    CommFields,
    CommGroup,
    CommKind,
    FieldsOp,
    SkipLink,
    Op,
    comm_fields,
    comm_from,
    counterpart_fields,
    group_from,
    lower_fields,
)

__all__ = [
    "COMM_MODELS",
    "ScheduleError",
    "ValidationReport",
    "validate",
    "run_lockstep",
    "lockstep_rounds",
    "peak_inflight",
]

COMM_MODELS = ("rendezvous", "buffered", "nccl")
"""Deadlock models accepted by :func:`validate` and :func:`simulate` (see module docstring)."""


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


def validate(schedule: Schedule, *, comm: str = "rendezvous",
             skips: Sequence[SkipLink] = ()) -> ValidationReport:
    """Check ``schedule`` and report its peak in-flight micro-batches and length.

    Raises :class:`ScheduleError` naming the stage, action and problem when an
    action is out of range, a (virtual stage, micro-batch) lacks or repeats its
    F or B (or repeats W), a stage runs an action before a same-stage dependency,
    or the lowered programs deadlock under the ``comm`` model (one of
    :data:`COMM_MODELS`). ``skips``: the model's skip connections, whose transfers the
    programs include too. Under ``"nccl"`` the programs are NCCL's (``lower_nccl``), else
    :func:`lower`'s.
    """
    _check_comm(comm)
    with gc_paused():
        _check_ranges(schedule)
        _check_complete(schedule)
        _check_local_order(schedule)
        # lower() without building the op objects; temporaries go before the collector resumes
        programs = (ANALYSES["lower_nccl"](schedule, skips=skips) if comm == "nccl"
                    else lower_fields(schedule, skips=skips))
        steps = _lockstep(programs, comm).run(schedule)
        return ValidationReport(peak_inflight(schedule), max(_last_steps(steps)), steps)


_DELTA = {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1, ActionKind.WEIGHT: 0}
_kind = attrgetter("kind")
_microbatch = attrgetter("microbatch")
_chunk = attrgetter("chunk")


ANALYSES["validate"] = validate


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most (chunk, micro-batch) pairs forwarded but not yet backwarded."""
    return tuple(
        max(0, max(accumulate(map(_DELTA.__getitem__, map(_kind, row))), default=0))
        for row in schedule.actions
    )


def _check_comm(comm: object) -> None:
    if comm not in COMM_MODELS:
        valid = ", ".join(repr(c) for c in COMM_MODELS)
        raise ValueError(f"comm={comm!r} is not a deadlock model; valid: {valid}")


def _last_steps(steps: tuple[tuple[int, ...], ...]) -> list[int]:
    return [row[-1] + 1 if row else 0 for row in steps]


# -- structural checks -------------------------------------------------------


def _check_ranges(schedule: Schedule) -> None:
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


def _check_complete(schedule: Schedule) -> None:
    sizes = _group_sizes(schedule)
    m = schedule.num_microbatches
    for stage, row in enumerate(schedule.actions):
        mine = sizes[stage]
        expected = ((kind, chunk) for chunk in range(schedule.num_chunks)
                    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD))
        if sum(mine.values()) == len(row) and all(mine.get(key) == m for key in expected):
            continue  # no repeats, and every F and B present (all are in range)
        _report_incomplete(schedule, stage, row)


def _group_sizes(schedule: Schedule) -> list[dict[tuple[ActionKind, int], int]]:
    """Per stage, the number of distinct micro-batches of each (kind, chunk)."""
    sizes: list[dict[tuple[ActionKind, int], int]] = [{} for _ in schedule.actions]
    for (stage, kind, chunk), actions in schedule._index.items():
        sizes[stage][kind, chunk] = len(actions)
    return sizes


def _report_incomplete(schedule: Schedule, stage: int, row: tuple[Action, ...]) -> None:
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


def _check_local_order(schedule: Schedule) -> None:
    for stage, row in enumerate(schedule.actions):
        if not _locally_ordered(schedule, stage):
            _report_local_order(schedule, stage, row)


def _locally_ordered(schedule: Schedule, stage: int) -> bool:
    """Whether every action of ``stage`` follows its dependencies on the same stage, compared
    group by group (each action appears once by now); ``False`` also when undecided."""
    positions = schedule._positions
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


def _report_local_order(schedule: Schedule, stage: int, row: tuple[Action, ...]) -> None:
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


# -- deadlock simulation -------------------------------------------------------


def run_lockstep(
    schedule: Schedule, programs: tuple[tuple[Op, ...], ...], *, comm: str = "rendezvous"
) -> tuple[tuple[int, ...], ...]:
    """Run lowered ``programs`` under the ``comm`` deadlock model (see module docstring).

    Returns, per stage, the round in which each compute action ran; raises
    :class:`ScheduleError` naming the blocked stages and their pending ops on deadlock.
    """
    _check_comm(comm)
    with gc_paused():
        simulation = _lockstep([list(map(_fields_op, program)) for program in programs], comm)
        return simulation.run(schedule)


def lockstep_rounds(schedule: Schedule, programs: Sequence[Sequence[FieldsOp]], *,
                    comm: str) -> tuple[tuple[int, ...], ...]:
    """:func:`run_lockstep` on programs in :func:`lower_fields`'s form (no op objects built)."""
    _check_comm(comm)
    with gc_paused():
        return _lockstep(programs, comm).run(schedule)


class _Other:
    """A program op that is neither an action nor a communication group: it never runs."""

    def __init__(self, op: object) -> None:
        self.op = op

    def __str__(self) -> str:
        return str(self.op)


_SimOp = Union[FieldsOp, _Other]


def _fields_op(op: object) -> _SimOp:
    if isinstance(op, CommGroup):
        return tuple(map(comm_fields, op.ops))
    return op if isinstance(op, Action) else _Other(op)


class _Lockstep:
    """One lock-step simulation of lowered programs, driven by events: a stage is looked at
    only when it reached a new op or a peer completed its group, so each round costs what
    happens in it. Rounds are those of the plain model (see module docstring)."""

    semantics = ""  # how the deadlock message names the model

    def __init__(self, programs: Sequence[Sequence[_SimOp]]) -> None:
        self.programs = programs
        self.pc = [0] * len(programs)
        self.pending: list[set[CommFields] | None] = [None] * len(programs)
        self.steps: list[list[int]] = [[] for _ in programs]
        self.round = 0
        self.finished = 0
        self.ready: list[int] = []  # stages at a compute action
        self.woken: list[int] = []  # stages to move on: a new op, or their group completed

    def run(self, schedule: Schedule) -> tuple[tuple[int, ...], ...]:
        """Rounds until every stage finished; raises :class:`ScheduleError` on deadlock."""
        steps, pc, woken, advance = self.steps, self.pc, self.woken, self._advance
        woken.extend(range(len(self.programs)))
        while True:
            while woken:
                advance(woken.pop())
            if self.finished == len(self.programs):
                return tuple(tuple(row) for row in steps)
            ready, self.ready, now = self.ready, [], self.round
            self.round += 1
            if not ready:
                raise ScheduleError(self.deadlock_message(schedule))
            for stage in ready:  # every stage at an action runs it this round, then moves on
                steps[stage].append(now)
                pc[stage] += 1
                advance(stage)

    def _advance(self, stage: int) -> None:
        """Post ``stage``'s communication groups until one waits or an action is next."""
        program, pc, post = self.programs[stage], self.pc[stage], self._post
        end = len(program)
        while pc < end:
            op = program[pc]
            if type(op) is tuple:
                if not post(stage, op):
                    break
                pc += 1
                continue
            if isinstance(op, Action):
                self.ready.append(stage)
            break
        else:
            self.finished += 1
        self.pc[stage] = pc

    def _post(self, stage: int, group: tuple[CommFields, ...]) -> bool:
        """Post ``group`` on ``stage``; ``True`` when all of it completed at once."""
        raise NotImplementedError

    def _move_on(self, stage: int) -> None:
        """``stage``'s group completed (by a peer's post): on to its next op."""
        self.pending[stage] = None
        self.pc[stage] += 1
        self.woken.append(stage)

    def current(self, stage: int) -> _SimOp | None:
        program = self.programs[stage]
        return program[self.pc[stage]] if self.pc[stage] < len(program) else None

    def deadlock_message(self, schedule: Schedule) -> str:
        lines = [
            f"schedule {schedule.name!r} deadlocks{self.semantics} after {self.round} rounds; "
            "blocked stages and their pending ops:"
        ]
        for stage in range(len(self.programs)):
            op = self.current(stage)
            if op is None:
                lines.append(f"  stage {stage}: finished")
                continue
            pending = sorted(map(comm_from, self.pending[stage] or ()), key=str)
            waiting = "; ".join(
                f"{c} waits for stage {c.peer} to post '{c.counterpart(stage)}'" for c in pending
            )
            shown = group_from(op) if type(op) is tuple else op
            lines.append(f"  stage {stage}: blocked {self._context(stage)} at {shown}: {waiting}")
        return "\n".join(lines)

    def _context(self, stage: int) -> str:
        done = [op for op in self.programs[stage][: self.pc[stage]] if isinstance(op, Action)]
        return f"after {done[-1]}" if done else "before its first action"


class _Rendezvous(_Lockstep):
    """Unbuffered sends: an op completes with its counterpart once both are posted."""

    def _post(self, stage: int, group: tuple[CommFields, ...]) -> bool:
        pending = self.pending
        ops = pending[stage] = set(group)
        for op in group:
            peer_ops = pending[op[2]]
            other = counterpart_fields(op, stage)
            if peer_ops is not None and other in peer_ops and op in ops:
                ops.discard(op)
                peer_ops.discard(other)
                if not peer_ops and peer_ops is not ops:
                    self._move_on(op[2])
        if ops:
            return False
        pending[stage] = None
        return True


class _Buffered(_Lockstep):
    """Buffered sends: a send completes at once, into the receiver's posted receive or else
    its mailbox; a receive completes from the mailbox."""

    def __init__(self, programs: Sequence[Sequence[_SimOp]]) -> None:
        super().__init__(programs)
        self.mailbox: list[set[CommFields]] = [set() for _ in programs]

    def _post(self, stage: int, group: tuple[CommFields, ...]) -> bool:
        if len(group) > 1 and _repeats(group):
            group = tuple(dict.fromkeys(group))  # a repeated op is posted once
        pending, mailbox = self.pending, self.mailbox
        for op in group:  # sends first, so that one to the stage itself reaches its receive
            if op[0] is CommKind.SEND:
                other, peer = counterpart_fields(op, stage), op[2]
                peer_ops = pending[peer]
                if peer_ops is not None and other in peer_ops:
                    peer_ops.discard(other)
                    if not peer_ops:
                        self._move_on(peer)
                else:
                    mailbox[peer].add(other)
        waiting, inbox = None, mailbox[stage]
        for op in group:
            if op[0] is CommKind.SEND:
                continue
            if op in inbox:
                inbox.discard(op)
            elif waiting is None:
                waiting = {op}
            else:
                waiting.add(op)
        pending[stage] = waiting
        return waiting is None


def _repeats(group: tuple[CommFields, ...]) -> bool:
    return group[0] == group[1] if len(group) == 2 else len(set(group)) < len(group)


def _lockstep(programs: Sequence[Sequence[_SimOp]], comm: str) -> _Lockstep | NcclModel:
    if comm == "nccl":
        return NcclModel(programs)
    return _Buffered(programs) if comm == "buffered" else _Rendezvous(programs)
