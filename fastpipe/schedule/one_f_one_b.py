"""1F1B (PipeDream-flush): warm-up forwards, alternate forward/backward, cool-down."""

from __future__ import annotations

from .actions import Action, B, F, gc_paused
from .checks import check_count, require_chunks
from .schedule import Schedule

__all__ = ["one_f_one_b"]


@gc_paused()
def one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B schedule: stage ``r`` runs ``min(p-r-1, m)`` warm-up forwards, then
    alternates one forward and one backward, then runs the remaining backwards.

    Same bubble as GPipe, but stage ``r`` holds at most ``min(p-r, m)``
    micro-batches in flight instead of ``m``. Works for any ``m >= 1``.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    require_chunks("1f1b", virtual_stages, 1, "interleaved")
    return Schedule("1f1b", p, m, tuple(_stage_row(r, p, m) for r in range(p)))


def _stage_row(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    row = [Action(stage, F, mb) for mb in range(warmup)]
    for mb in range(warmup, num_microbatches):
        row += [Action(stage, F, mb), Action(stage, B, mb - warmup)]
    row += [Action(stage, B, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return tuple(row)
