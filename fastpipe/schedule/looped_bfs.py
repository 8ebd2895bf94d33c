"""Looped BFS: breadth-first over round-robin virtual stages, GPipe-like per chunk."""

from __future__ import annotations

from .actions import Action, B, F, gc_paused
from .checks import check_count
from .schedule import Schedule

__all__ = ["looped_bfs"]


@gc_paused()
def looped_bfs(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Looped BFS schedule: each stage runs every forward of chunk 0, then of chunk 1,
    ..., then every backward of chunk ``v-1``, ..., of chunk 0.

    Micro-batches run in order ``0..m-1`` within a chunk, forwards and backwards
    alike (as in :func:`gpipe`). Chunks are placed round-robin, as in
    ``torch.distributed.pipelining.ScheduleLoopedBFS``. Works for any ``m >= 1``;
    every stage holds all ``m*v`` (chunk, micro-batch) activations at its peak.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("virtual_stages", virtual_stages)
    rows = tuple(_stage_row(stage, m, v) for stage in range(p))
    return Schedule("looped-bfs", p, m, rows, num_chunks=v)


def _stage_row(stage: int, m: int, v: int) -> tuple[Action, ...]:
    forwards = [Action(stage, F, mb, chunk) for chunk in range(v) for mb in range(m)]
    backwards = [Action(stage, B, mb, chunk) for chunk in reversed(range(v)) for mb in range(m)]
    return tuple(forwards + backwards)
