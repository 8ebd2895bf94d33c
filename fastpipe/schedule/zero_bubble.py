"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with deferred weight gradients.

The backward is split into ``B`` (input gradient, on the critical path) and
``W`` (weight gradient, needed only by the optimizer step). Stage ``r`` runs
1F1B's order with ``B`` in place of the full backward and delays each ``W`` by
``r`` micro-batches, so the later stages, which wait least in warm-up, fill
their cool-down waits with weight gradients.
"""

from __future__ import annotations

from .actions import Action, B, F, W, gc_paused
from .checks import check_count, require_chunks
from .schedule import Schedule

__all__ = ["zb_h1"]


@gc_paused()
def zb_h1(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 schedule: stage ``r`` runs ``min(p-r-1, m)`` warm-up forwards, then rounds
    ``F(j + warm-up), B(j), W(j - r)`` (each where it exists), then the remaining ``W``.

    Peak in-flight micro-batches, counted until their ``W``, is ``min(p, m)`` on every
    stage (1F1B's peak, reached on its stage 0). With unit-time F, B and W and
    ``m >= p`` it takes ``3m + p - 1`` rounds: ``p - 1`` idle per stage, a third of
    1F1B's ``3(p - 1)`` with B+W fused.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    require_chunks("zb-h1", virtual_stages, 1, "zbv")
    return Schedule("zb-h1", p, m, tuple(_stage_row(r, p, m) for r in range(p)))



def _stage_row(stage: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - stage - 1, m)
    row = [Action(stage, F, mb) for mb in range(warmup)]
    for j in range(m):
        if j + warmup < m:
            row.append(Action(stage, F, j + warmup))
        row.append(Action(stage, B, j))
        if j >= stage:
            row.append(Action(stage, W, j - stage))
    row += [Action(stage, W, mb) for mb in range(max(m - stage, 0), m)]
    return tuple(row)
