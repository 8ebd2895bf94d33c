"""Schedules written as PyTorch pipelining's action strings (see
:mod:`fastpipe.schedule.interchange`): compute actions by virtual stage, and the transfers of a
fastpipe lowering as ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``."""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import Action, ActionKind
from .ir import ScheduleData
from .lower import Comm, CommKind, Op, Payload, lower
from .nccl import lower_nccl

__all__ = ["action_text", "comm_text", "to_actions"]

_LOWERINGS = {"lower": lower, "nccl": lower_nccl}


def to_actions(schedule: ScheduleData, *, comms: Optional[str] = None) -> list[list[str]]:
    """``schedule`` as pipelining's action strings, one list per rank. ``comms``: ``None``
    (compute actions only), ``"lower"`` or ``"nccl"`` (the programs of
    :func:`~fastpipe.schedule.lower.lower` or :func:`~fastpipe.schedule.nccl.lower_nccl`,
    each group's sends and receives in the group's order)."""
    if comms is not None and comms not in _LOWERINGS:
        raise ValueError(f"comms={comms!r} is not a lowering; valid: None, 'lower', 'nccl'")
    if comms is None:
        return [[action_text(schedule, a) for a in row] for row in schedule.actions]
    return [_program_texts(schedule, program) for program in _LOWERINGS[comms](schedule)]


def action_text(schedule: ScheduleData, action: Action) -> str:
    """One compute action as pipelining writes it: its virtual stage, ``F``, ``W``, ``B`` (a
    full backward) or ``I`` (a backward whose ``W`` is separate), its micro-batch."""
    stage = schedule.virtual_stage_of(action)
    kind = action.kind.value
    if action.kind is ActionKind.BACKWARD and (stage, action.microbatch) in \
            schedule.split_backwards:
        kind = "I"
    return f"{stage}{kind}{action.microbatch}"


def comm_text(comm: Comm) -> str:
    """One transfer as pipelining writes it, named by the stage of the rank that runs it."""
    kind = "SEND" if comm.kind is CommKind.SEND else "RECV"
    what = "F" if comm.what is Payload.ACT else "B"
    return f"{comm.virtual_stage}{kind}_{what}{comm.microbatch}"


def _program_texts(schedule: ScheduleData, program: Sequence[Op]) -> list[str]:
    out: list[str] = []
    for op in program:
        if isinstance(op, Action):
            out.append(action_text(schedule, op))
        else:
            out.extend(comm_text(comm) for comm in op.ops)
    return out
