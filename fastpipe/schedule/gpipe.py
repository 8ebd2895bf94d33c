"""GPipe: all forwards, then all backwards, on every stage."""

from __future__ import annotations

from .ir import Action, B, F, Schedule, check_count

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe schedule: each stage runs forwards ``0..m-1``, then backwards ``0..m-1``.

    Backwards run in micro-batch order ``0..m-1``, as in torchgpipe and
    ``torch.distributed.pipelining.ScheduleGPipe``. Every stage holds all ``m``
    micro-batches' activations at its peak.
    """
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    _one_chunk(virtual_stages)
    rows = tuple(
        tuple(Action(stage, F, mb) for mb in range(num_microbatches))
        + tuple(Action(stage, B, mb) for mb in range(num_microbatches))
        for stage in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, rows)


def _one_chunk(virtual_stages: object) -> None:
    if check_count("virtual_stages", virtual_stages) != 1:
        raise ValueError(
            f"gpipe runs one chunk per stage: virtual_stages must be 1, got "
            f"{virtual_stages}; use schedule 'looped-bfs' for several chunks per stage"
        )
