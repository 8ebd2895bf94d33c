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
``send_forward_recv_backward``. The validator and the executors share this pass; the
validator takes it as :func:`lower_fields`, with each group's ops left as tuples of fields.

The executors lower with ``local=True`` (transfers between chunks of one stage become ops too,
sent to the stage itself, so every message a step hands over is an op of the program) and with
the model's skip connections (:class:`SkipLink`: a tensor one virtual stage stashes and a later
one pops, and its gradient on the way back). Each receive op is the key of its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import NamedTuple, Optional, Sequence, Union

from .actions import Action, ActionKind, gc_paused
from .checks import check_count
from .ir import ScheduleData

__all__ = ["CommKind", "Payload", "SkipLink", "Comm", "CommGroup", "Op", "lower",
           "format_program"]


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


class SkipLink(NamedTuple):
    """A skip connection: virtual stage ``src`` stashes a tensor named ``name`` that the later
    virtual stage ``dst`` pops; its gradient goes back from ``dst`` to ``src``."""

    name: str
    src: int
    dst: int


@dataclass(frozen=True)
class Comm:
    """One point-to-point op seen from the stage that runs it.

    ``virtual_stage`` is the local virtual stage whose compute produces (send)
    or consumes (recv) the tensor; ``peer`` is the other physical stage. ``skip`` is the skip
    connection the tensor belongs to (``None``: the tensor between neighbouring virtual stages).
    String form: ``"send act3 v0->1"``, ``"recv grad3 v0<-1"``, ``"recv act3[h] v2<-0"``.
    """

    kind: CommKind
    what: Payload
    peer: int
    microbatch: int
    virtual_stage: int
    skip: Optional[SkipLink] = None

    def __post_init__(self) -> None:
        if type(self.kind) is not CommKind:
            object.__setattr__(self, "kind", CommKind(self.kind))
        if type(self.what) is not Payload:
            object.__setattr__(self, "what", Payload(self.what))
        if self.skip is not None and type(self.skip) is not SkipLink:
            object.__setattr__(self, "skip", SkipLink(*self.skip))
        peer, microbatch, virtual_stage = self.peer, self.microbatch, self.virtual_stage
        if (type(peer) is int and type(microbatch) is int and type(virtual_stage) is int
                and peer >= 0 and microbatch >= 0 and virtual_stage >= 0):
            return  # the common case, kept cheap
        for name in ("peer", "microbatch", "virtual_stage"):
            check_count(f"Comm.{name}", getattr(self, name), minimum=0)

    def __hash__(self) -> int:
        """The fields' hash, computed once: a comm is a mailbox key, looked up per action."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.kind, self.what, self.peer, self.microbatch, self.virtual_stage,
                           self.skip))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """Pickled without the cached hash (string hashes differ between processes)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __str__(self) -> str:
        arrow = "->" if self.kind is CommKind.SEND else "<-"
        name = "" if self.skip is None else f"[{self.skip.name}]"
        return (f"{self.kind} {self.what}{self.microbatch}{name} "
                f"v{self.virtual_stage}{arrow}{self.peer}")

    def counterpart(self, stage: int) -> Comm:
        """The op the peer must post to match this op, which runs on ``stage``."""
        return comm_from(counterpart_fields(comm_fields(self), stage))


CommFields = tuple[CommKind, Payload, int, int, int, Optional[SkipLink]]
"""A :class:`Comm`'s fields in order: the form in which the validator simulates transfers."""

_new_object, _set = object.__new__, object.__setattr__


def comm_fields(comm: Comm) -> CommFields:
    """The fields of ``comm`` as a tuple (equal tuples for equal ops)."""
    return (comm.kind, comm.what, comm.peer, comm.microbatch, comm.virtual_stage, comm.skip)


def counterpart_fields(fields: CommFields, stage: int) -> CommFields:
    """:meth:`Comm.counterpart` of the op with ``fields`` that runs on ``stage``, as fields."""
    kind, what, _, microbatch, virtual_stage, skip = fields
    if skip is not None:  # the other end of the skip connection
        virtual_stage = skip.dst if virtual_stage == skip.src else skip.src
    else:
        step = 1 if what is Payload.ACT else -1  # activations go up, gradients down
        virtual_stage += -step if kind is CommKind.RECV else step
    kind = CommKind.RECV if kind is CommKind.SEND else CommKind.SEND
    if type(stage) is not int or stage < 0 or virtual_stage < 0:  # rejected as Comm() would
        return comm_fields(Comm(kind, what, stage, microbatch, virtual_stage, skip))
    return (kind, what, stage, microbatch, virtual_stage, skip)


def comm_from(fields: CommFields) -> Comm:
    """``Comm(*fields)`` for fields already known to be valid, without the checks."""
    kind, what, peer, microbatch, virtual_stage, skip = fields
    comm = _new_object(Comm)
    _set(comm, "kind", kind)
    _set(comm, "what", what)
    _set(comm, "peer", peer)
    _set(comm, "microbatch", microbatch)
    _set(comm, "virtual_stage", virtual_stage)
    _set(comm, "skip", skip)
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


def lower(schedule: ScheduleData, *, batched: bool = True, local: bool = False,
          skips: Sequence[SkipLink] = ()) -> tuple[tuple[Op, ...], ...]:
    """Lower every stage's actions into a program of compute and communication ops.

    ``batched=False`` gives every communication op its own group; it exists to
    show why batching matters (unbatched 1F1B deadlocks under rendezvous sends).
    ``local=True`` adds the transfers between chunks of one stage (as ops with the stage itself
    as peer); ``skips`` adds the transfers of skip connections.
    """
    with gc_paused():  # the fields go once turned into ops, before the collector resumes
        lowered = lower_fields(schedule, batched=batched, local=local, skips=skips)
        return tuple(tuple(map(_op, program)) for program in lowered)


def lower_fields(schedule: ScheduleData, *, batched: bool = True, local: bool = False,
                 skips: Sequence[SkipLink] = ()) -> tuple[list[FieldsOp], ...]:
    """:func:`lower` with each :class:`CommGroup` given as the tuple of its ops' fields
    (:data:`CommFields`): the validator simulates this form without building the objects."""
    links = _Links(schedule, local, tuple(skips))
    with gc_paused():
        return tuple(_lower_stage(links, row, batched) for row in schedule.actions)


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


_Transfers = tuple[tuple[Payload, int, Optional[SkipLink]], ...]
"""The (payload, peer, skip connection) of each receive, or of each send, of an action."""

_Plan = tuple[int, "_Transfers | None", "_Transfers | None"]
"""For a (stage, kind, chunk) group: its virtual stage, and the transfers of each of its
actions before and after it (``None``: ask the schedule action by action)."""


class _Links:
    """Which transfers a lowering makes: between the virtual stages of a dependency when they
    sit on different stages (or, with ``local``, on any two chunks), and along skip connections."""

    def __init__(self, schedule: ScheduleData, local: bool, skips: tuple[SkipLink, ...]) -> None:
        self.schedule, self.local, self.skips = schedule, local, skips

    def wanted(self, stage: int, chunk: int, peer: int, peer_chunk: int) -> bool:
        """Whether a tensor of chunk ``peer_chunk`` on ``peer`` to or from ``chunk`` on
        ``stage`` is an op (a dependency within one chunk moves no tensor)."""
        return peer != stage or (self.local and peer_chunk != chunk)

    def skip_transfers(self, stage: int, kind: ActionKind, vs: int,
                       receiving: bool) -> _Transfers:
        """Receiving: the skip tensors a forward of ``vs`` pops, or the skip gradients its
        backward takes; otherwise the skip tensors a forward stashes, or the gradients a
        backward sends back."""
        if kind is ActionKind.WEIGHT:
            return ()
        what = Payload.ACT if kind is ActionKind.FORWARD else Payload.GRAD
        from_producer = receiving == (kind is ActionKind.FORWARD)
        out = []
        for skip in self.skips:
            here, other = (skip.dst, skip.src) if from_producer else (skip.src, skip.dst)
            if here == vs:
                peer = self.schedule.stage_of(other)[0]
                if self.local or peer != stage:
                    out.append((what, peer, skip))
        return tuple(out)


def _lower_stage(links: _Links, row: tuple[Action, ...], batched: bool) -> list[FieldsOp]:
    program: list[FieldsOp] = []
    pending: list[CommFields] = []
    plans: dict[tuple[int, ActionKind, int], _Plan] = {}
    recv, send = CommKind.RECV, CommKind.SEND
    for key, mb, action in zip(map(_group_of, row), map(_microbatch, row), row):
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _plan(links, key)
        vs, receives, sends = plan
        for what, peer, skip in _receives(links, action) if receives is None else receives:
            pending.append((recv, what, peer, mb, vs, skip))
        if pending:
            _flush(program, pending, batched)
        program.append(action)
        for what, peer, skip in _sends(links, action) if sends is None else sends:
            pending.append((send, what, peer, mb, vs, skip))
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


def _plan(links: _Links, key: tuple[int, ActionKind, int]) -> _Plan:
    """The transfers of every action of a group, from the schedule's dependency groups."""
    schedule, wanted = links.schedule, links.wanted
    stage, kind, chunk = key
    vs = schedule.virtual_stage(stage, chunk)
    deps = schedule.dependency_groups(stage, kind, chunk)
    users = schedule.consumer_groups(stage, kind, chunk)
    receives = None if deps is None else tuple(
        (_payload(dep_kind), peer, None) for peer, dep_kind, peer_chunk in deps
        if wanted(stage, chunk, peer, peer_chunk)) + links.skip_transfers(stage, kind, vs, True)
    sends = None if users is None else tuple(
        (_payload(kind), peer, None) for peer, _, peer_chunk in users
        if wanted(stage, chunk, peer, peer_chunk)) + links.skip_transfers(stage, kind, vs, False)
    return vs, receives, sends


def _receives(links: _Links, action: Action) -> _Transfers:
    """(payload, peer, None) of each dependency of ``action`` that travels, then its skips."""
    schedule, stage, chunk = links.schedule, action.stage, action.chunk
    deps = schedule.dependencies(action)
    return tuple((_payload(dep.kind), dep.stage, None) for dep in deps
                 if links.wanted(stage, chunk, dep.stage, dep.chunk)) + links.skip_transfers(
        stage, action.kind, schedule.virtual_stage_of(action), True)


def _sends(links: _Links, action: Action) -> _Transfers:
    """(payload, peer, None) of each consumer of ``action`` that travels, then its skips."""
    schedule, stage, chunk = links.schedule, action.stage, action.chunk
    users = schedule.consumers(action)
    return tuple((_payload(action.kind), u.stage, None) for u in users
                 if links.wanted(stage, chunk, u.stage, u.chunk)) + links.skip_transfers(
        stage, action.kind, schedule.virtual_stage_of(action), False)


def _payload(producer: ActionKind) -> Payload:
    return Payload.ACT if producer is ActionKind.FORWARD else Payload.GRAD
