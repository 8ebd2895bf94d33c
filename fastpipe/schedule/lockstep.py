"""The lock-step deadlock simulation of lowered programs, under a transport's semantics.

Every stage runs its lowered program (:func:`~fastpipe.schedule.lower.lower`) in order,
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
has no tags).

``comm="buffered"`` models mailbox hand-over instead, as the local executor
does: a send completes as soon as it is posted and its tensor waits in the
receiver's mailbox; a receive completes once its matching send was posted. A
schedule is then deadlock-free exactly when its per-stage orders and its data
dependencies admit a common order, whatever the send ordering.

The simulation is driven by events: it looks at a stage only when the stage reached a new
op or a peer completed its group, so it costs what the ops cost, not rounds x stages. It
sits below both the validator and the NCCL lowering (whose reference run is the buffered
simulation), so neither imports the other's way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from .actions import Action, gc_paused
from .checks import ScheduleError
from .ir import ScheduleData
from .lower import (
    CommFields,
    CommGroup,
    CommKind,
    FieldsOp,
    Op,
    comm_fields,
    comm_from,
    counterpart_fields,
    group_from,
)
from .nccl_model import NcclModel

__all__ = ["COMM_MODELS", "check_comm", "lockstep_rounds", "run_lockstep"]

COMM_MODELS = ("rendezvous", "buffered", "nccl")
"""Deadlock models accepted by the validator and :func:`run_lockstep` (see module docstring)."""


def check_comm(comm: object) -> None:
    """Reject a ``comm`` that is not one of :data:`COMM_MODELS`."""
    if comm not in COMM_MODELS:
        valid = ", ".join(repr(c) for c in COMM_MODELS)
        raise ValueError(f"comm={comm!r} is not a deadlock model; valid: {valid}")


def run_lockstep(
    schedule: ScheduleData, programs: tuple[tuple[Op, ...], ...], *, comm: str = "rendezvous"
) -> tuple[tuple[int, ...], ...]:
    """Run lowered ``programs`` under the ``comm`` deadlock model (see module docstring).

    Returns, per stage, the round in which each compute action ran; raises
    :class:`ScheduleError` naming the blocked stages and their pending ops on deadlock.
    """
    check_comm(comm)
    with gc_paused():
        simulation = _lockstep([list(map(_fields_op, program)) for program in programs], comm)
        return simulation.run(schedule)


def lockstep_rounds(schedule: ScheduleData, programs: Sequence[Sequence[FieldsOp]], *,
                    comm: str) -> tuple[tuple[int, ...], ...]:
    """:func:`run_lockstep` on programs in :func:`~fastpipe.schedule.lower.lower_fields`'s form
    (no op objects built)."""
    check_comm(comm)
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

    def run(self, schedule: ScheduleData) -> tuple[tuple[int, ...], ...]:
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

    def deadlock_message(self, schedule: ScheduleData) -> str:
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
