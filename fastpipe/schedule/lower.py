"""Communication lowering: turn each stage's compute actions into a program of ops.

Before a compute action come the receives it needs (a dependency computed on
another physical stage, see :meth:`Schedule.dependencies`); after it come the
sends it produces (a consumer on another physical stage, see
:meth:`Schedule.consumers`). Forward dependencies carry activations, backward
ones carry gradients. Chunks on the same physical stage exchange tensors
locally and get no communication op.

With ``batched=True`` (the default) all communication between two compute
actions -- the sends of the one before and the receives of the one after -- is
merged into one :class:`CommGroup`, posted and waited on together, like
``torch.distributed.batch_isend_irecv`` or Megatron's
``send_forward_recv_backward``. The validator and the executor share this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

from .ir import Action, ActionKind, Schedule, check_count, _plain_counts

__all__ = ["CommKind", "Payload", "Comm", "CommGroup", "Op", "lower", "format_program"]


class CommKind(str, Enum):
    """Direction of a point-to-point operation."""

    SEND = "send"
    RECV = "recv"

    def __str__(self) -> str:
        return self.value


class Payload(str, Enum):
    """What travels: activations flow forward, gradients flow backward."""

    ACT = "act"
    GRAD = "grad"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Comm:
    """One point-to-point op seen from the stage that runs it.

    ``virtual_stage`` is the local virtual stage whose compute produces (send)
    or consumes (recv) the tensor; ``peer`` is the other physical stage.
    String form: ``"send act3 v0->1"``, ``"recv grad3 v0<-1"``.
    """

    kind: CommKind
    what: Payload
    peer: int
    microbatch: int
    virtual_stage: int

    def __post_init__(self) -> None:
        if type(self.kind) is not CommKind:
            object.__setattr__(self, "kind", CommKind(self.kind))
        if type(self.what) is not Payload:
            object.__setattr__(self, "what", Payload(self.what))
        if _plain_counts(self.peer, self.microbatch, self.virtual_stage):
            return
        for name in ("peer", "microbatch", "virtual_stage"):
            check_count(f"Comm.{name}", getattr(self, name), minimum=0)

    def __str__(self) -> str:
        arrow = "->" if self.kind is CommKind.SEND else "<-"
        return f"{self.kind} {self.what}{self.microbatch} v{self.virtual_stage}{arrow}{self.peer}"

    def counterpart(self, stage: int) -> Comm:
        """The op the peer must post to match this op, which runs on ``stage``."""
        step = 1 if self.what is Payload.ACT else -1  # activations go up, gradients down
        if self.kind is CommKind.RECV:
            step = -step
        kind = CommKind.RECV if self.kind is CommKind.SEND else CommKind.SEND
        return Comm(kind, self.what, stage, self.microbatch, self.virtual_stage + step)


@dataclass(frozen=True)
class CommGroup:
    """Communication ops posted together and completed together (one batched call)."""

    ops: tuple[Comm, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))

    def __str__(self) -> str:
        return "[" + " | ".join(str(op) for op in self.ops) + "]"


Op = Union[Action, CommGroup]
"""An op of a lowered program: a compute action or a communication group."""


def lower(schedule: Schedule, *, batched: bool = True) -> tuple[tuple[Op, ...], ...]:
    """Lower every stage's actions into a program of compute and communication ops.

    ``batched=False`` gives every communication op its own group; it exists to
    show why batching matters (unbatched 1F1B deadlocks under rendezvous sends).
    """
    return tuple(_lower_stage(schedule, row, batched) for row in schedule.actions)


def format_program(program: tuple[Op, ...]) -> str:
    """One stage's program as a single line of space-separated op strings."""
    return " ".join(str(op) for op in program)


def _lower_stage(schedule: Schedule, row: tuple[Action, ...], batched: bool) -> tuple[Op, ...]:
    program: list[Op] = []
    pending: list[Comm] = []
    for action in row:
        pending += _receives(schedule, action)
        _flush(program, pending, batched)
        program.append(action)
        pending = list(_sends(schedule, action))
    _flush(program, pending, batched)
    return tuple(program)


def _flush(program: list[Op], pending: list[Comm], batched: bool) -> None:
    if batched and pending:
        program.append(CommGroup(tuple(pending)))
    elif not batched:
        program.extend(CommGroup((op,)) for op in pending)
    pending.clear()


def _receives(schedule: Schedule, action: Action) -> list[Comm]:
    vs = schedule.virtual_stage_of(action)
    return [
        Comm(CommKind.RECV, _payload(dep), dep.stage, action.microbatch, vs)
        for dep in schedule.dependencies(action)
        if dep.stage != action.stage
    ]


def _sends(schedule: Schedule, action: Action) -> list[Comm]:
    vs = schedule.virtual_stage_of(action)
    return [
        Comm(CommKind.SEND, _payload(action), user.stage, action.microbatch, vs)
        for user in schedule.consumers(action)
        if user.stage != action.stage
    ]


def _payload(producer: Action) -> Payload:
    return Payload.ACT if producer.kind is ActionKind.FORWARD else Payload.GRAD
