"""The NCCL lowering: each rank's program of grouped point-to-point ops, deadlock-free by
construction.

NCCL runs a communicator's sends and receives on one stream, in issue order; a send waits for
its matching receive, and the ops between two ranks pair in the order they are posted (there
are no tags). Two ranks that both send first deadlock; a receive posted early blocks the sends
behind it. This lowering orders every rank's communication by one global clock:

1. A reference run gives every action a time: its round in the buffered lock-step simulation
   (unit-time actions, each as soon as its inputs exist), ties broken by stage. Every action
   comes after the actions whose tensors it takes, so the times are a topological order.
2. Every transfer belongs to one *exchange*: the action that consumes it. Its receive is posted
   by the consumer's rank right before that action; its send by the producer's rank at the
   same time on the global clock (after the producer's last action before it), not when the
   tensor is produced.
3. Each exchange is one group (``batch_isend_irecv``) on each rank it involves, and a rank
   posts its groups in exchange-time order. Within a group, ops are sorted by (sender,
   receiver, what, micro-batch, stage), the same key on both ends.

Why it cannot deadlock: by induction on exchange time ``t``, once every exchange before ``t``
completed and every action before ``t`` ran, every rank taking part in exchange ``t`` has
reached its group for ``t`` (its earlier groups are earlier exchanges, its earlier actions
earlier times); the group's ops are then all posted on both ends, in the same order per pair,
so they complete, and the consumer at ``t`` runs. The validator's NCCL model checks this proof
on every schedule (``validate(schedule, comm="nccl")``), and ``DistributedPipe`` checks the
programs it runs once, when first lowered.

The price of the construction is one group per exchange rather than one per pair of actions
(a sender's ops for different consumers are not merged), which is also what lets a message's
size change between steps: its header tells the receiver, and the payload follows in a
second group of the same exchange, which no other exchange can be waiting behind.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Sequence

from .ir import ANALYSES, Action, Schedule, gc_paused
from .lower import (CommFields, CommKind, FieldsOp, Op, SkipLink, counterpart_fields, group_from,
                    lower_fields)
from .validate import lockstep_rounds

__all__ = ["lower_nccl", "nccl_fields", "pair_key"]

Time = tuple[int, int]  # (round of the reference run, stage): a total order of the actions


def lower_nccl(schedule: Schedule, *,
               skips: Sequence[SkipLink] = ()) -> tuple[tuple[Op, ...], ...]:
    """Every stage's program of compute actions and NCCL groups (see module docstring).

    Transfers between chunks of one stage are no ops (they never leave the rank); ``skips``
    adds the transfers of the model's skip connections.
    """
    with gc_paused():
        return tuple(tuple(group_from(op) if type(op) is tuple else op for op in program)
                     for program in nccl_fields(schedule, skips=skips))


def nccl_fields(schedule: Schedule, *,
                skips: Sequence[SkipLink] = ()) -> tuple[list[FieldsOp], ...]:
    """:func:`lower_nccl` with each group given as the tuple of its ops' fields."""
    with gc_paused():
        base = lower_fields(schedule, local=False, skips=tuple(skips))
        rounds = lockstep_rounds(schedule, base, comm="buffered")
        entries = [_split(program) for program in base]
        slot = {(stage, op): (rounds[stage][i], stage)
                for stage, rows in enumerate(entries)
                for i, (_, receives, _) in enumerate(rows) for op in receives}
        return tuple(_program(stage, rows, rounds[stage], slot)
                     for stage, rows in enumerate(entries))


ANALYSES["lower_nccl"] = nccl_fields


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
             slot: dict[tuple[int, CommFields], Time]) -> list[FieldsOp]:
    """One stage's NCCL program: its actions at their times, each exchange's group at the
    exchange's time (before the action, when this stage is the consumer)."""
    sends: dict[Time, list[CommFields]] = {}
    items: list[tuple[Time, int, FieldsOp]] = []
    for (action, receives, outgoing), when in zip(rows, rounds):
        now = (when, stage)
        if receives:
            items.append((now, 0, _sorted(stage, receives)))
        items.append((now, 1, action))
        for op in outgoing:
            at = slot[(op[2], counterpart_fields(op, stage))]
            group = sends.setdefault(at, [])
            if op not in group:
                group.append(op)
    items += [(at, 0, _sorted(stage, group)) for at, group in sends.items()]
    items.sort(key=itemgetter(0, 1))
    return [op for _, _, op in items]


def _sorted(stage: int, ops: list[CommFields]) -> tuple[CommFields, ...]:
    return tuple(sorted(ops, key=lambda op: pair_key(stage, op)))
