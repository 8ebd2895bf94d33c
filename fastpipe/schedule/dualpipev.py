"""DualPipeV (DeepSeek's DualPipe cut in half) as a sequence of F, B and W actions.

V placement as in ZB-V: stage ``r`` holds virtual stages ``r`` (chunk 0) and
``2p-1-r`` (chunk 1). DualPipeV overlaps a chunk-0 forward with a chunk-1
backward (and the reverse) in one fused step; the IR has no fused action, so
each overlapped pair is written forward first, then backward. Most backwards
are full; only those DualPipeV runs "zero-bubble" get a separate, deferred
``W``, taken first-in first-out.
"""

from __future__ import annotations

from collections import deque

from .actions import Action, B, F, W, gc_paused
from .checks import check_count
from .schedule import Schedule
from .zbv import RowBuilder, keep_microbatches, two_chunks, v_placement

__all__ = ["dualpipev"]


@gc_paused()
def dualpipev(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV schedule: DeepSeek's eight phases per stage (see :func:`_stage_row`).

    DualPipeV needs ``m >= 2p``; for fewer micro-batches the schedule is built
    for ``2p`` and the extra micro-batches are dropped.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    two_chunks("dualpipev", virtual_stages)
    built = max(m, 2 * p)
    rows = tuple(keep_microbatches(_stage_row(r, p, built), m) for r in range(p))
    return Schedule("dualpipev", p, m, rows, num_chunks=2, placement=v_placement(p))


class _Stage(RowBuilder):
    """A row builder with DualPipeV's queue of deferred weight gradients."""

    def __init__(self, stage: int) -> None:
        super().__init__(stage)
        self.deferred: deque[Action] = deque()

    def backward(self, chunk: int, split: bool = False) -> None:
        """A backward on ``chunk``; with ``split`` its ``W`` is queued for :meth:`weight`."""
        action = self.add(B, chunk)
        if split:
            self.deferred.append(action)

    def weight(self) -> None:
        """Run the oldest queued weight gradient."""
        self.append(self.deferred.popleft().with_kind(W))


def _stage_row(r: int, p: int, m: int) -> tuple[Action, ...]:
    """Stage ``r``'s phases, for ``m >= 2p`` (``.c`` = chunk ``c``, ``B*`` = split backward):

    1. ``2(p-r-1)`` ``F.0``;            2. ``r+1`` x ``F.0 F.1``;
    3. ``p-r-1`` x ``B*.1 W F.1``;      4. ``m-2p+r+1`` x ``F.0 B.1 F.1 B.0``;
    5. ``p-r-1`` x ``B.1 F.1 B.0``;     6. ``r+1`` x ``B.1 B.0``, split from the middle on;
    7. ``p-r-1`` x ``W B*.0``;          8. ``r+1`` x ``W``.
    """
    row = _Stage(r)
    row.repeat(2 * (p - r - 1), (F, 0))
    row.repeat(r + 1, (F, 0), (F, 1))
    for _ in range(p - r - 1):
        row.backward(1, split=True)
        row.weight()
        row.add(F, 1)
    row.repeat(m - 2 * p + r + 1, (F, 0), (B, 1), (F, 1), (B, 0))
    row.repeat(p - r - 1, (B, 1), (F, 1), (B, 0))
    _drain(row, r)
    for _ in range(p - r - 1):
        row.weight()
        row.backward(0, split=True)
    for _ in range(r + 1):
        row.weight()
    return tuple(row.actions)


def _drain(row: _Stage, r: int) -> None:
    """Phase 6: backwards split from pair ``(r+1)//2`` on; odd stages split that
    pair's ``B.1`` too, even stages only its ``B.0``."""
    middle = (r + 1) // 2
    for i in range(r + 1):
        row.backward(1, split=i > middle or (i == middle and r % 2 == 1))
        row.backward(0, split=i >= middle)
