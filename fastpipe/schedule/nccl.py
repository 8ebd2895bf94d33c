"""The NCCL lowering: each rank's program of grouped point-to-point ops, deadlock-free by
construction.

NCCL runs a communicator's sends and receives on one stream, in issue order; a send waits for
its matching receive, and the ops between two ranks pair in the order they are posted (there
are no tags). Two ranks that both send first deadlock; a receive posted early blocks the sends
behind it. This lowering orders every rank's communication by one global clock:

1. A reference run gives every action a round: the buffered lock-step simulation (unit-time
   actions, each as soon as its inputs exist and its stage is free). Every action comes after
   the actions whose tensors it takes.
2. Every transfer belongs to the round of the action that consumes it. A rank posts, between
   its actions of rounds ``r - 1`` and ``r``, one group (``batch_isend_irecv``) holding its ops
   of every transfer of round ``r``: the receives of its own action of round ``r``, and the sends
   whose consumer runs in round ``r`` on another rank. So a send goes right after its producer
   when the consumer runs as soon as it can, later when the consumer's stage is busy (never
   merely because the tensor exists), and a rank's sends and receives of one round travel
   together (Megatron's ``send_forward_recv_backward``, for every schedule).
3. Within a group, ops are sorted by (sender, receiver, what, skip connection, micro-batch,
   stage): the same key on both ends, so the ops between two ranks pair in the same order.

Why it cannot deadlock: by induction on the round ``r``. Once every group and action of the
rounds before ``r`` completed, every rank's group of round ``r`` is at the head of its stream,
and every op in it has its counterpart in the peer's group of round ``r``, in the same order:
they all pair and complete, and the actions of round ``r`` find their receives done. A message
whose size changed since the previous step takes a second group in the same round (its header,
in the first, tells the receiver), which nothing else can be waiting behind. The validator's NCCL
model checks the result on every schedule (``validate(schedule, comm="nccl")``), and
``DistributedPipe`` checks the programs it runs once, when first lowered.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Sequence

from .actions import Action, gc_paused
from .ir import ScheduleData
from .lockstep import lockstep_rounds
from .lower import (CommFields, CommKind, FieldsOp, Op, SkipLink, counterpart_fields, group_from,
                    lower_fields)

__all__ = ["lower_nccl", "nccl_fields", "pair_key"]


def lower_nccl(schedule: ScheduleData, *, skips: Sequence[SkipLink] = (),
               prefetch: bool = False) -> tuple[tuple[Op, ...], ...]:
    """Every stage's program of compute actions and NCCL groups (see module docstring).

    Transfers between chunks of one stage are no ops (they never leave the rank); ``skips``
    adds the transfers of the model's skip connections. ``prefetch``: a group of receives only
    is moved ahead of the action before it, so that they are in flight while the action
    computes. That changes no stream's order of groups (the CPU only enqueues the group
    sooner), so the proof holds; executors post such a group, run the action, then wait for
    the group. (A group with sends stays put: a rank that failed in the action in between
    would leave a peer waiting for the rest of a message.)
    """
    with gc_paused():
        return tuple(tuple(group_from(op) if type(op) is tuple else op for op in program)
                     for program in nccl_fields(schedule, skips=skips, prefetch=prefetch))


def nccl_fields(schedule: ScheduleData, *, skips: Sequence[SkipLink] = (),
                prefetch: bool = False) -> tuple[list[FieldsOp], ...]:
    """:func:`lower_nccl` with each group given as the tuple of its ops' fields."""
    with gc_paused():
        base = lower_fields(schedule, local=False, skips=tuple(skips))
        rounds = lockstep_rounds(schedule, base, comm="buffered")
        entries = [_split(program) for program in base]
        slot = {(stage, op): rounds[stage][i]
                for stage, rows in enumerate(entries)
                for i, (_, receives, _) in enumerate(rows) for op in receives}
        programs = tuple(_program(stage, rows, rounds[stage], slot)
                         for stage, rows in enumerate(entries))
        if prefetch:
            programs = tuple(_prefetched(program) for program in programs)
        return programs


def pair_key(stage: int, op: CommFields) -> tuple:
    """The order of ``op`` (run on ``stage``) among the ops of its group, equal on both ends of
    a transfer: (sender, receiver, payload, skip connection, micro-batch, receiving stage)."""
    kind, what, peer, microbatch, virtual_stage, skip = op
    if kind is CommKind.SEND:
        src, dst = stage, peer
        virtual_stage = counterpart_fields(op, stage)[4]
    else:
        src, dst = peer, stage
    return (src, dst, what.value, "" if skip is None else skip.name, microbatch, virtual_stage)


_Entry = tuple[Action, list[CommFields], list[CommFields]]


def _split(program: Sequence[FieldsOp]) -> list[_Entry]:
    """Each action of a lowered program with the receives before it and the sends after it."""
    entries: list[_Entry] = []
    receives: list[CommFields] = []
    for op in program:
        if type(op) is tuple:
            for comm in op:
                if comm[0] is CommKind.SEND:
                    entries[-1][2].append(comm)
                elif comm not in receives:
                    receives.append(comm)
        else:
            entries.append((op, receives, []))
            receives = []
    return entries


def _program(stage: int, rows: list[_Entry], rounds: Sequence[int],
             slot: dict[tuple[int, CommFields], int]) -> list[FieldsOp]:
    """One stage's NCCL program: its actions in their rounds, and before the action of each
    round, one group with this stage's ops of every exchange of that round."""
    groups: dict[int, list[CommFields]] = {}
    actions: list[tuple[int, Action]] = []
    for (action, receives, outgoing), when in zip(rows, rounds):
        groups.setdefault(when, []).extend(receives)
        actions.append((when, action))
        for op in outgoing:
            groups.setdefault(slot[(op[2], counterpart_fields(op, stage))], []).append(op)
    items: list[tuple[int, int, FieldsOp]] = [(when, 1, action) for when, action in actions]
    items += [(when, 0, _sorted(stage, list(dict.fromkeys(ops))))
              for when, ops in groups.items() if ops]
    items.sort(key=itemgetter(0, 1))
    return [op for _, _, op in items]


def _prefetched(program: list[FieldsOp]) -> list[FieldsOp]:
    """``program`` with each group of receives only moved ahead of the action before it."""
    out: list[FieldsOp] = []
    for op in program:
        if type(op) is tuple and out and isinstance(out[-1], Action) and all(
                comm[0] is CommKind.RECV for comm in op):
            out.insert(len(out) - 1, op)
        else:
            out.append(op)
    return out


def _sorted(stage: int, ops: list[CommFields]) -> tuple[CommFields, ...]:
    return tuple(sorted(ops, key=lambda op: pair_key(stage, op)))
