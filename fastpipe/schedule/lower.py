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
``send_forward_recv_backward``. The validator and the executor share this pass; the
validator takes it as :func:`lower_fields`, with each group's ops left as tuples of fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import Union

from .ir import Action, ActionKind, Schedule, check_count, gc_paused

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
        peer, microbatch, virtual_stage = self.peer, self.microbatch, self.virtual_stage
        if (type(peer) is int and type(microbatch) is int and type(virtual_stage) is int
                and peer >= 0 and microbatch >= 0 and virtual_stage >= 0):
            return  # the common case, kept cheap
        for name in ("peer", "microbatch", "virtual_stage"):
            check_count(f"Comm.{name}", getattr(self, name), minimum=0)

    def __str__(self) -> str:
        arrow = "->" if self.kind is CommKind.SEND else "<-"
        return f"{self.kind} {self.what}{self.microbatch} v{self.virtual_stage}{arrow}{self.peer}"

    def counterpart(self, stage: int) -> Comm:
        """The op the peer must post to match this op, which runs on ``stage``."""
        return comm_from(counterpart_fields(comm_fields(self), stage))


CommFields = tuple[CommKind, Payload, int, int, int]
"""A :class:`Comm`'s fields in order: the form in which the validator simulates transfers."""

_new_object, _set = object.__new__, object.__setattr__


def comm_fields(comm: Comm) -> CommFields:
    """The fields of ``comm`` as a tuple (equal tuples for equal ops)."""
    return (comm.kind, comm.what, comm.peer, comm.microbatch, comm.virtual_stage)


def counterpart_fields(fields: CommFields, stage: int) -> CommFields:
    """:meth:`Comm.counterpart` of the op with ``fields`` that runs on ``stage``, as fields."""
    kind, what, _, microbatch, virtual_stage = fields
    step = 1 if what is Payload.ACT else -1  # activations go up, gradients down
    if kind is CommKind.RECV:
        step = -step
    kind = CommKind.RECV if kind is CommKind.SEND else CommKind.SEND
    virtual_stage += step
    if type(stage) is not int or stage < 0 or virtual_stage < 0:  # rejected as Comm() would
        return comm_fields(Comm(kind, what, stage, microbatch, virtual_stage))
    return (kind, what, stage, microbatch, virtual_stage)


def comm_from(fields: CommFields) -> Comm:
    """``Comm(*fields)`` for fields already known to be valid, without the checks."""
    kind, what, peer, microbatch, virtual_stage = fields
    comm = _new_object(Comm)
    _set(comm, "kind", kind)
    _set(comm, "what", what)
    _set(comm, "peer", peer)
    _set(comm, "microbatch", microbatch)
    _set(comm, "virtual_stage", virtual_stage)
    return comm


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

FieldsOp = Union[Action, tuple[CommFields, ...]]
"""An op of :func:`lower_fields`: a compute action, or a group as its ops' fields."""


def lower(schedule: Schedule, *, batched: bool = True) -> tuple[tuple[Op, ...], ...]:
    """Lower every stage's actions into a program of compute and communication ops.

    ``batched=False`` gives every communication op its own group; it exists to
    show why batching matters (unbatched 1F1B deadlocks under rendezvous sends).
    """
    with gc_paused():  # the fields go once turned into ops, before the collector resumes
        programs = (tuple(map(_op, program)) for program in lower_fields(schedule, batched=batched))
        return tuple(programs)


def lower_fields(schedule: Schedule, *, batched: bool = True) -> tuple[list[FieldsOp], ...]:
    """:func:`lower` with each :class:`CommGroup` given as the tuple of its ops' fields
    (:data:`CommFields`): the validator simulates this form without building the objects."""
    with gc_paused():
        return tuple(_lower_stage(schedule, row, batched) for row in schedule.actions)


def format_program(program: tuple[Op, ...]) -> str:
    """One stage's program as a single line of space-separated op strings."""
    return " ".join(str(op) for op in program)


def group_from(op: tuple[CommFields, ...]) -> CommGroup:
    """The :class:`CommGroup` of a group given as its ops' fields."""
    group = _new_object(CommGroup)
    _set(group, "ops", tuple(map(comm_from, op)))
    return group


def _op(op: FieldsOp) -> Op:
    return group_from(op) if type(op) is tuple else op


_Transfers = tuple[tuple[Payload, int], ...]
"""The (payload, peer) of each receive, or of each send, of an action."""

_Plan = tuple[int, "_Transfers | None", "_Transfers | None"]
"""For a (stage, kind, chunk) group: its virtual stage, and the transfers of each of its
actions before and after it (``None``: ask the schedule action by action)."""


def _lower_stage(schedule: Schedule, row: tuple[Action, ...], batched: bool) -> list[FieldsOp]:
    program: list[FieldsOp] = []
    pending: list[CommFields] = []
    plans: dict[tuple[int, ActionKind, int], _Plan] = {}
    recv, send = CommKind.RECV, CommKind.SEND
    for key, mb, action in zip(map(_group_of, row), map(_microbatch, row), row):
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _plan(schedule, key)
        vs, receives, sends = plan
        for what, peer in _receives(schedule, action) if receives is None else receives:
            pending.append((recv, what, peer, mb, vs))
        if pending:
            _flush(program, pending, batched)
        program.append(action)
        for what, peer in _sends(schedule, action) if sends is None else sends:
            pending.append((send, what, peer, mb, vs))
    _flush(program, pending, batched)
    return program


_group_of = attrgetter("stage", "kind", "chunk")
_microbatch = attrgetter("microbatch")


def _flush(program: list[FieldsOp], pending: list[CommFields], batched: bool) -> None:
    if batched and pending:
        program.append(tuple(pending))
    elif not batched:
        program.extend((op,) for op in pending)
    pending.clear()


def _plan(schedule: Schedule, key: tuple[int, ActionKind, int]) -> _Plan:
    """The transfers of every action of a group, from the schedule's dependency groups."""
    stage, kind, chunk = key
    vs = schedule.virtual_stage(stage, chunk)
    deps = schedule.dependency_groups(stage, kind, chunk)
    users = schedule.consumer_groups(stage, kind, chunk)
    receives = None if deps is None else tuple(
        (_payload(dep_kind), peer) for peer, dep_kind, _ in deps if peer != stage)
    sends = None if users is None else tuple(
        (_payload(kind), peer) for peer, _, _ in users if peer != stage)
    return vs, receives, sends


def _receives(schedule: Schedule, action: Action) -> _Transfers:
    """(payload, peer) of each dependency of ``action`` on another stage."""
    deps = schedule.dependencies(action)
    return tuple((_payload(dep.kind), dep.stage) for dep in deps if dep.stage != action.stage)


def _sends(schedule: Schedule, action: Action) -> _Transfers:
    """(payload, peer) of each consumer of ``action`` on another stage."""
    users = schedule.consumers(action)
    return tuple((_payload(action.kind), u.stage) for u in users if u.stage != action.stage)


def _payload(producer: ActionKind) -> Payload:
    return Payload.ACT if producer is ActionKind.FORWARD else Payload.GRAD
