"""The validator's NCCL deadlock model: a CPU and one FIFO communication stream per rank.

What NCCL does with a communicator's point-to-point ops, as the model has it:

- A rank's CPU runs its program in order. A communication group is *enqueued* on the rank's
  stream (``batch_isend_irecv`` returns at once) and the CPU goes on; a compute action waits
  until the groups holding the receives it consumes have completed (a CUDA event), then takes
  one round.
- The stream runs its groups one after another, each as one operation: only the group at the
  head of a stream is active, and the stream moves on when every op of it completed.
- A send completes only together with its receive, when both are in the active groups of the
  two ranks' streams (no buffering), and the ops between two ranks pair in the order they are
  posted, whatever their fields (NCCL has no tags): a pair that does not match is an error.

So a receive enqueued early blocks every op behind it on the stream, the sends of the actions
the CPU runs meanwhile included: the pattern that hangs pipelines on NCCL. A deadlock raises
:class:`ScheduleError` naming every rank's CPU position and the head of its stream.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from .actions import Action, ActionKind
from .checks import ScheduleError
from .ir import ScheduleData
from .lower import CommFields, CommKind, Payload, comm_from, counterpart_fields, group_from

__all__ = ["NcclModel", "consumer_of"]

Consumer = tuple[int, ActionKind, int]  # (virtual stage, kind, micro-batch) of an action


class _Group:
    """A group on a stream: its ops, and those not yet paired, per ordered pair of stages."""

    def __init__(self, stage: int, ops: tuple[CommFields, ...]) -> None:
        self.ops = ops
        self.left = len(ops)
        self.sends: dict[int, deque[CommFields]] = {}  # receiving stage -> unpaired sends
        self.receives: dict[int, deque[CommFields]] = {}  # sending stage -> unpaired receives
        for op in ops:
            side = self.sends if op[0] is CommKind.SEND else self.receives
            side.setdefault(op[2], deque()).append(op)


class NcclModel:
    """One run of lowered programs under the NCCL model (see module docstring); :meth:`run`
    returns the round of every compute action, per stage, like the lock-step models."""

    def __init__(self, programs: Sequence[Sequence[Any]]) -> None:
        self.programs = programs
        count = len(programs)
        self.pc = [0] * count
        self.streams: list[deque[_Group]] = [deque() for _ in range(count)]
        self.done: list[set[CommFields]] = [set() for _ in range(count)]  # completed receives
        self.waiting: list[dict[Consumer, int]] = [{} for _ in range(count)]  # receives in flight
        self.steps: list[list[int]] = [[] for _ in range(count)]
        self.round = 0

    def run(self, schedule: ScheduleData) -> tuple[tuple[int, ...], ...]:
        self.schedule = schedule
        for stage in range(len(self.programs)):
            self._advance(stage)
        while True:
            ready = [s for s in range(len(self.programs)) if self._ready(s)]
            if not ready:
                if all(self._finished(s) for s in range(len(self.programs))):
                    return tuple(tuple(row) for row in self.steps)
                raise ScheduleError(self._deadlock_message())
            for stage in ready:
                self.steps[stage].append(self.round)
                self.pc[stage] += 1
            self.round += 1
            for stage in ready:
                self._advance(stage)

    # ---------------------------------------------------------------- the CPU
    def _advance(self, stage: int) -> None:
        """Enqueue ``stage``'s groups until its CPU reaches a compute action (or the end)."""
        program = self.programs[stage]
        while self.pc[stage] < len(program):
            op = program[self.pc[stage]]
            if type(op) is not tuple:
                return
            self._enqueue(stage, op)
            self.pc[stage] += 1

    def _ready(self, stage: int) -> bool:
        """Whether the CPU is at an action whose receives all completed."""
        program, pc = self.programs[stage], self.pc[stage]
        if pc >= len(program) or not isinstance(program[pc], Action):
            return False
        return not self.waiting[stage].get(self._consumer(program[pc]), 0)

    def _finished(self, stage: int) -> bool:
        return self.pc[stage] >= len(self.programs[stage]) and not self.streams[stage]

    def _consumer(self, action: Action) -> Consumer:
        return (self.schedule.virtual_stage_of(action), action.kind, action.microbatch)

    # ---------------------------------------------------------------- the streams
    def _enqueue(self, stage: int, ops: tuple[CommFields, ...]) -> None:
        if len(set(ops)) < len(ops):
            raise ScheduleError(f"stage {stage} posts an op twice in one group "
                                f"{group_from(ops)}: NCCL would pair each copy with another op")
        for op in ops:
            if op[0] is CommKind.RECV:
                key = consumer_of(op)
                self.waiting[stage][key] = self.waiting[stage].get(key, 0) + 1
        stream = self.streams[stage]
        stream.append(_Group(stage, ops))
        if len(stream) == 1:
            self._activate(stage)

    def _activate(self, stage: int) -> None:
        """The head group of ``stage``'s stream pairs its ops with the peers' head groups;
        every group that completes lets the next one of its stream in."""
        work = [stage]
        while work:
            s = work.pop()
            stream = self.streams[s]
            if not stream:
                continue
            head = stream[0]
            for peer in sorted(set(head.sends) | set(head.receives)):
                if self.streams[peer]:
                    self._pair(s, head, peer, self.streams[peer][0])
            for t in {s, *head.sends, *head.receives}:
                if self.streams[t] and self.streams[t][0].left == 0:
                    self._complete(t)
                    work.append(t)

    def _pair(self, stage: int, head: _Group, peer: int, other: _Group) -> None:
        """Pair, in posting order, the unpaired ops of two active groups between their stages."""
        for mine, theirs in ((head.sends.get(peer), other.receives.get(stage)),
                             (head.receives.get(peer), other.sends.get(stage))):
            while mine and theirs:
                op, match = mine.popleft(), theirs.popleft()
                if match != counterpart_fields(op, stage):
                    raise ScheduleError(_mismatch(stage, op, peer, match))
                head.left -= 1
                other.left -= 1

    def _complete(self, stage: int) -> None:
        group = self.streams[stage].popleft()
        for op in group.ops:
            if op[0] is CommKind.RECV:
                self.waiting[stage][consumer_of(op)] -= 1

    # ---------------------------------------------------------------- errors
    def _deadlock_message(self) -> str:
        lines = [f"schedule {self.schedule.name!r} deadlocks under NCCL semantics (one FIFO "
                 f"stream per rank, unbuffered sends) after {self.round} rounds:"]
        for stage, program in enumerate(self.programs):
            pc = self.pc[stage]
            done = [op for op in program[:pc] if isinstance(op, Action)]
            where = f"after {done[-1]}" if done else "before its first action"
            cpu = (f"CPU at {program[pc]} (waiting for its receives)" if pc < len(program)
                   else "CPU finished")
            stream = self.streams[stage]
            if not stream:
                lines.append(f"  stage {stage}: {cpu} {where}; stream empty")
                continue
            head = stream[0]
            unpaired = [op for ops in (*head.sends.values(), *head.receives.values())
                        for op in ops]
            waits = "; ".join(f"'{comm_from(op)}' waits for stage {op[2]}'s stream to reach "
                              f"'{comm_from(counterpart_fields(op, stage))}'"
                              for op in unpaired)
            lines.append(f"  stage {stage}: {cpu} {where}; stream blocked at "
                         f"{group_from(head.ops)} ({len(stream) - 1} groups behind it): {waits}")
        return "\n".join(lines)


def consumer_of(op: CommFields) -> Consumer:
    """The action that consumes a received tensor: the forward (activations) or the backward
    (gradients) of its virtual stage and micro-batch."""
    kind = ActionKind.FORWARD if op[1] is Payload.ACT else ActionKind.BACKWARD
    return (op[4], kind, op[3])


def _mismatch(stage: int, op: CommFields, peer: int, other: CommFields) -> str:
    mine, theirs = comm_from(op), comm_from(other)
    return (f"stage {stage} posts '{mine}' and stage {peer}'s next unpaired op with it is "
            f"'{theirs}': NCCL pairs the ops between two ranks in the order they are posted (it "
            f"has no tags), so this would deliver the wrong tensor or hang on a size mismatch; "
            f"post the ops between each pair of ranks in the same order on both")
