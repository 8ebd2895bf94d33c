"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism"): zero-bubble over a V placement.

Stage ``r`` holds virtual stages ``r`` (chunk 0, on the way down) and
``2p-1-r`` (chunk 1, on the way back up), so the first and the last virtual
stage sit on stage 0 and each micro-batch's forward turns at stage ``p-1``.
Backwards are split into ``B`` (input gradient) and ``W`` (weight gradient).
"""

from __future__ import annotations

from collections import deque

from .actions import Action, ActionKind, B, F, W, gc_paused, trusted_action
from .checks import check_count, require_chunks
from .schedule import Schedule

__all__ = ["zbv", "v_placement", "RowBuilder"]

Step = tuple[ActionKind, int]
"""A (kind, chunk) pair; :class:`RowBuilder` supplies the micro-batch."""


@gc_paused()
def zbv(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V schedule on the V placement, in phases chosen so no stage waits once
    the pipeline is full (see :func:`_stage_row`).

    With unit-time F, B and W it takes ``6m + p - 1`` rounds for ``m >= 2p``, the
    least possible. Peak in-flight (chunk, micro-batch) pairs, counted until their
    ``W``, is ``2p`` per stage for ``m >= 2p - 1``: as many half-size chunk
    activations as 1F1B's ``p`` full ones. Built for ``max(m, 2p - 1)``
    micro-batches; for fewer, the extra ones are dropped.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    two_chunks("zbv", virtual_stages)
    built = max(m, 2 * p - 1)
    rows = tuple(keep_microbatches(_stage_row(r, p, built), m) for r in range(p))
    return Schedule("zbv", p, m, rows, num_chunks=2, placement=v_placement(p))


def v_placement(num_stages: int) -> tuple[tuple[int, int], ...]:
    """V placement: stage ``r`` holds virtual stages ``r`` (chunk 0) and ``2p-1-r`` (chunk 1)."""
    return tuple((r, 2 * num_stages - 1 - r) for r in range(num_stages))


def two_chunks(schedule: str, virtual_stages: object) -> None:
    """Reject any ``virtual_stages`` but 2: V-shaped schedules hold exactly two chunks per stage."""
    require_chunks(schedule, virtual_stages, 2, "interleaved")


def keep_microbatches(row: tuple[Action, ...], num_microbatches: int) -> tuple[Action, ...]:
    """``row`` without the actions of micro-batches ``>= num_microbatches``.

    Dropping whole micro-batches from a deadlock-free schedule keeps it
    deadlock-free (under buffered sends), which lets small ``m`` reuse a
    generator built for a full pipeline.
    """
    return tuple(a for a in row if a.microbatch < num_microbatches)


class RowBuilder:
    """One stage's action row, handing out micro-batches in order per (kind, chunk)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._plain = type(stage) is int and stage >= 0  # actions need no checks but kind, chunk
        self.actions: list[Action] = []
        self._next: dict[Step, int] = {}

    def count(self, kind: ActionKind, chunk: int) -> int:
        """How many actions of ``kind`` on ``chunk`` the row has so far."""
        return self._next.get((kind, chunk), 0)

    def add(self, kind: ActionKind, chunk: int) -> Action:
        """Append the next micro-batch's ``kind`` action on ``chunk`` and return it."""
        mb = self._next.get((kind, chunk), 0)
        self._next[kind, chunk] = mb + 1
        if self._plain and type(kind) is ActionKind and type(chunk) is int and chunk >= 0:
            action = trusted_action(self.stage, kind, mb, chunk)
        else:
            action = Action(self.stage, kind, mb, chunk)
        self.actions.append(action)
        return action

    def append(self, action: Action) -> None:
        """Append ``action`` as is (e.g. the ``W`` of an earlier ``B``)."""
        self.actions.append(action)

    def repeat(self, times: int, *steps: Step) -> None:
        """Append the sequence ``steps`` ``times`` times."""
        for _ in range(times):
            for kind, chunk in steps:
                self.add(kind, chunk)


def _stage_row(stage: int, p: int, m: int) -> tuple[Action, ...]:
    """Stage ``r``'s phases, for ``m >= 2p - 1``:

    1. ``2(p-r)-1`` chunk-0 forwards (until the first chunk-1 input arrives);
    2. ``r`` pairs ``F.1 F.0`` (chunk-1 inputs arrive every other step);
    3. ``p-r`` triples ``F.1 B.1 W.1`` (chunk-1 gradients start arriving);
    4. rounds ``F.0 B.0 W.0 F.1 B.1 W.1`` while chunk-1 forwards remain (``F.0`` only
       while one remains);
    5. cool-down: ``r`` pairs ``B.1 B.0``, then ``B.0`` each followed by a deferred ``W``,
       then the deferred ``W`` (oldest first).
    """
    row = RowBuilder(stage)
    row.repeat(2 * (p - stage) - 1, (F, 0))
    row.repeat(stage, (F, 1), (F, 0))
    row.repeat(p - stage, (F, 1), (B, 1), (W, 1))
    while row.count(F, 1) < m:
        if row.count(F, 0) < m:
            row.add(F, 0)
        row.repeat(1, (B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    _cooldown(row, stage, p)
    return tuple(row.actions)


def _cooldown(row: RowBuilder, stage: int, p: int) -> None:
    deferred: deque[Action] = deque()
    for _ in range(stage):
        deferred += [row.add(B, 1), row.add(B, 0)]
    for _ in range(p - stage):
        deferred.append(row.add(B, 0))
        row.append(deferred.popleft().with_kind(W))
    for backward in deferred:
        row.append(backward.with_kind(W))
