"""GPipe: all forwards, then all backwards, on every stage."""

from __future__ import annotations

from .actions import Action, B, F, gc_paused
from .checks import check_count, require_chunks
from .schedule import Schedule

__all__ = ["gpipe"]


@gc_paused()
def gpipe(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe schedule: each stage runs forwards ``0..m-1``, then backwards ``0..m-1``.

    Backwards run in micro-batch order ``0..m-1``, as in torchgpipe and
    ``torch.distributed.pipelining.ScheduleGPipe``. Every stage holds all ``m``
    micro-batches' activations at its peak.
    """
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    require_chunks("gpipe", virtual_stages, 1, "looped-bfs")
    rows = tuple(
        tuple(Action(stage, F, mb) for mb in range(num_microbatches))
        + tuple(Action(stage, B, mb) for mb in range(num_microbatches))
        for stage in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, rows)
