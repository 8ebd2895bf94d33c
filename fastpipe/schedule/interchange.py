"""Schedules shared with PyTorch's ``torch.distributed.pipelining`` and torchtitan.

They write a schedule as one list of action strings per rank (see
:mod:`fastpipe.schedule.interchange_cells`), naming a *virtual* stage (model order) where
fastpipe names a physical stage (the rank) and a chunk. :func:`to_actions` writes a
:class:`Schedule` that way (``B`` of a backward whose weight gradient is a separate ``W`` is
pipelining's ``I``; with ``comms``, the sends and receives of fastpipe's lowering as
``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``); :func:`from_actions` reads it back.

Reading infers the placement from which row (rank) runs which stage: rank ``r`` holds the
stages it runs, its chunks in model order. Every rank must hold as many; the placement is
round-robin (``"loop"``: interleaved 1F1B's) or a V (``"v-shape"``: ZB-V's, DualPipeV's,
zig-zag for more chunks) or any other (``"custom"``), see :func:`placement_kind`. Before a
:class:`Schedule` is returned, every action must be in range and present once (``I`` with its
``W``), each rank's order must run an action after its inputs from the same rank, and the lists
must not deadlock under the NCCL model (``validate(comm="nccl")``); communication actions, where
given, must be exactly the transfers of fastpipe's lowering of the compute actions, a receive
before the action that takes it, a send after the one that makes it. fastpipe does not run a
file's order of communication: it lowers the compute actions itself (``lower_nccl``, deadlock-free
by construction). ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` are skipped
(:data:`~fastpipe.schedule.interchange_cells.IGNORED` says why). Each error is an
:class:`~fastpipe.schedule.interchange_cells.InterchangeError` (a :class:`ScheduleError`)
naming the row and index, or the file's line and column.
"""

from __future__ import annotations

from typing import Optional

from .interchange_cells import InterchangeError, Locator
from .interchange_export import to_actions
from .interchange_read import Rows, build_schedule
from .ir import Placement, ScheduleData, round_robin_placement
from .schedule import Schedule

__all__ = ["InterchangeError", "from_actions", "placement_kind", "to_actions"]


def from_actions(rows: Rows, *, name: str = "imported",
                 num_microbatches: Optional[int] = None) -> Schedule:
    """The :class:`Schedule` of pipelining's action lists, one per rank (see module docstring);
    errors name ``row r, index i``. ``num_microbatches`` defaults to the number of micro-batches
    the compute actions name."""
    return build_schedule(rows, Locator(), name, num_microbatches)


def placement_kind(placement: Placement | ScheduleData) -> str:
    """``"loop"`` (round-robin: rank ``r`` holds stages ``r, r+p, ...``), ``"v-shape"`` (rank
    ``r`` holds ``r, 2p-1-r``, zig-zag on for more chunks) or ``"custom"``."""
    table = placement.placement if isinstance(placement, ScheduleData) else placement
    p, v = len(table), len(table[0])
    if tuple(map(tuple, table)) == round_robin_placement(p, v):
        return "loop"
    zigzag = tuple(tuple(c * p + (r if c % 2 == 0 else p - 1 - r) for c in range(v))
                   for r in range(p))
    return "v-shape" if tuple(map(tuple, table)) == zigzag else "custom"
