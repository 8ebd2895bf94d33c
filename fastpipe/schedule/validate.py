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

``comm="buffered"`` models mailbox hand-over instead, as the local executor
does: a send completes as soon as it is posted and its tensor waits in the
receiver's mailbox; a receive completes once its matching send was posted. A
schedule is then deadlock-free exactly when its per-stage orders and its data
dependencies admit a common order, whatever the send ordering.

Cross-stage data dependencies (``F`` after the previous virtual stage's ``F``,
``B`` after the next virtual stage's ``B``) are enforced by the receives, so
the simulation also checks them; dependencies between actions on the same
stage are checked directly against the stage's order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .ir import Action, ActionKind, Schedule, ScheduleError
from .lower import Comm, CommGroup, CommKind, Op, lower

__all__ = [
    "COMM_MODELS",
    "ScheduleError",
    "ValidationReport",
    "validate",
    "run_lockstep",
    "peak_inflight",
]

COMM_MODELS = ("rendezvous", "buffered")
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


def validate(schedule: Schedule, *, comm: str = "rendezvous") -> ValidationReport:
    """Check ``schedule`` and report its peak in-flight micro-batches and length.

    Raises :class:`ScheduleError` naming the stage, action and problem when an
    action is out of range, a (virtual stage, micro-batch) lacks or repeats its
    F or B (or repeats W), a stage runs an action before a same-stage dependency,
    or the lowered programs deadlock under the ``comm`` model (one of
    :data:`COMM_MODELS`).
    """
    _check_comm(comm)
    _check_ranges(schedule)
    _check_complete(schedule)
    _check_local_order(schedule)
    steps = run_lockstep(schedule, lower(schedule), comm=comm)
    return ValidationReport(peak_inflight(schedule), max(_last_steps(steps)), steps)


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most (chunk, micro-batch) pairs forwarded but not yet backwarded."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for action in row:
            live += {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1}.get(action.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


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
    for stage, row in enumerate(schedule.actions):
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
    sim = _Simulation(programs, buffered=comm == "buffered")
    while True:
        sim.settle_communication()
        if sim.finished():
            return tuple(tuple(row) for row in sim.steps)
        if not sim.run_compute():
            raise ScheduleError(sim.deadlock_message(schedule))


class _Simulation:
    """Mutable state of one lock-step simulation of lowered programs."""

    def __init__(self, programs: tuple[tuple[Op, ...], ...], buffered: bool = False) -> None:
        self.programs = programs
        self.buffered = buffered
        self.mailbox: list[set[Comm]] = [set() for _ in programs]
        self.pc = [0] * len(programs)
        self.pending: list[set[Comm] | None] = [None] * len(programs)
        self.steps: list[list[int]] = [[] for _ in programs]
        self.round = 0

    def current(self, stage: int) -> Op | None:
        program = self.programs[stage]
        return program[self.pc[stage]] if self.pc[stage] < len(program) else None

    def finished(self) -> bool:
        return all(self.current(s) is None for s in range(len(self.programs)))

    def run_compute(self) -> bool:
        ran = False
        for stage in range(len(self.programs)):
            if isinstance(self.current(stage), Action):
                self.steps[stage].append(self.round)
                self.pc[stage] += 1
                ran = True
        self.round += 1
        return ran

    def settle_communication(self) -> None:
        changed = True
        while changed:
            changed = self._post() | self._match() | self._complete()

    def _post(self) -> bool:
        posted = False
        for stage in range(len(self.programs)):
            op = self.current(stage)
            if isinstance(op, CommGroup) and self.pending[stage] is None:
                self.pending[stage] = set(op.ops)
                posted = True
        return posted

    def _match(self) -> bool:
        if self.buffered:
            return self._deliver()
        matched = False
        for stage, ops in enumerate(self.pending):
            for op in list(ops or ()):
                peer_ops = self.pending[op.peer]
                other = op.counterpart(stage)
                if peer_ops is not None and other in peer_ops:
                    ops.discard(op)
                    peer_ops.discard(other)
                    matched = True
        return matched

    def _deliver(self) -> bool:
        """Buffered model: posted sends complete into the peer's mailbox; receives
        complete from their own mailbox."""
        moved = False
        for stage, ops in enumerate(self.pending):
            for op in list(ops or ()):
                if op.kind is CommKind.SEND:
                    self.mailbox[op.peer].add(op.counterpart(stage))
                elif op in self.mailbox[stage]:
                    self.mailbox[stage].discard(op)
                else:
                    continue
                ops.discard(op)
                moved = True
        return moved

    def _complete(self) -> bool:
        done = False
        for stage, ops in enumerate(self.pending):
            if ops is not None and not ops:
                self.pending[stage] = None
                self.pc[stage] += 1
                done = True
        return done

    def deadlock_message(self, schedule: Schedule) -> str:
        lines = [
            f"schedule {schedule.name!r} deadlocks after {self.round} rounds; "
            "blocked stages and their pending ops:"
        ]
        for stage in range(len(self.programs)):
            op = self.current(stage)
            if op is None:
                lines.append(f"  stage {stage}: finished")
                continue
            waiting = "; ".join(
                f"{c} waits for stage {c.peer} to post '{c.counterpart(stage)}'"
                for c in sorted(self.pending[stage] or (), key=str)
            )
            lines.append(
                f"  stage {stage}: blocked {self._context(stage)} at {op}: {waiting}"
            )
        return "\n".join(lines)

    def _context(self, stage: int) -> str:
        done = [op for op in self.programs[stage][: self.pc[stage]] if isinstance(op, Action)]
        return f"after {done[-1]}" if done else "before its first action"

