"""Interleaved 1F1B (Megatron's virtual pipeline): ``v`` round-robin chunks per stage.

Every stage walks the same sequence of ``m*v`` (chunk, micro-batch) units:
micro-batches go in groups of ``p`` (the last group holds what is left), and a
group visits chunks ``0..v-1`` in turn, so forward unit ``k`` of a full group is
chunk ``(k // p) % v``, micro-batch ``(k // (p*v)) * p + k % p`` (Megatron's
``get_model_chunk_id``). Backward units are the same with chunk order reversed.

With ``v > 1``, ``m`` must be a multiple of ``p`` (Megatron's rule) or at most
``p`` (a single group): a short group behind full ones can deadlock.
"""

from __future__ import annotations

from .actions import Action, ActionKind, B, F, gc_paused, trusted_action
from .checks import check_count
from .schedule import Schedule

__all__ = ["interleaved", "interleaved_units", "interleaved_warmup"]

Unit = tuple[int, int]
"""A (chunk, micro-batch) pair."""


@gc_paused()
def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B over ``virtual_stages`` round-robin chunks per stage.

    Stage ``r`` runs :func:`interleaved_warmup` forwards, then alternates one forward
    and one backward, then runs the remaining backwards. ``virtual_stages=1`` is 1F1B.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("virtual_stages", virtual_stages)
    _check_supported(p, m, v)
    forward = interleaved_units(p, m, v)
    backward = interleaved_units(p, m, v, reverse=True)
    rows = tuple(
        _stage_row(r, forward, backward, interleaved_warmup(r, p, m, v)) for r in range(p)
    )
    return Schedule("interleaved", p, m, rows, num_chunks=v)


def interleaved_units(
    num_stages: int, num_microbatches: int, num_chunks: int, reverse: bool = False
) -> list[Unit]:
    """The (chunk, micro-batch) order every stage follows for forwards (or, with
    ``reverse``, backwards): groups of ``num_stages`` micro-batches, chunk by chunk."""
    chunks = range(num_chunks - 1, -1, -1) if reverse else range(num_chunks)
    units: list[Unit] = []
    for first in range(0, num_microbatches, num_stages):
        group = range(first, min(first + num_stages, num_microbatches))
        units += [(chunk, mb) for chunk in chunks for mb in group]
    return units


def interleaved_warmup(stage: int, num_stages: int, num_microbatches: int, num_chunks: int) -> int:
    """Forwards stage ``stage`` runs before its first backward.

    Megatron's ``(p - r - 1) * 2 + (v - 1) * p`` capped at ``m * v``; for ``v = 1``
    Megatron runs plain 1F1B, whose warm-up is ``p - r - 1``.
    """
    hops = num_stages - stage - 1
    if num_chunks == 1:
        return min(hops, num_microbatches)
    return min(hops * 2 + (num_chunks - 1) * num_stages, num_microbatches * num_chunks)


def _check_supported(p: int, m: int, v: int) -> None:
    # a short last group behind full ones can deadlock, e.g. p=4, m=5, v=3
    if v > 1 and m > p and m % p:
        lower, upper = m - m % p, m - m % p + p
        raise ValueError(
            f"interleaved with virtual_stages={v} chunks per stage needs num_microbatches "
            f"to be a multiple of num_stages={p} (or below it), got num_microbatches={m}; "
            f"use a multiple of num_stages such as {lower} or {upper}, or virtual_stages=1"
        )


def _stage_row(
    stage: int, forward: list[Unit], backward: list[Unit], warmup: int
) -> tuple[Action, ...]:
    def action(kind: ActionKind, unit: Unit) -> Action:
        return trusted_action(stage, kind, unit[1], unit[0])  # checked counts, built units

    row = [action(F, unit) for unit in forward[:warmup]]
    for k in range(len(forward) - warmup):
        row += [action(F, forward[warmup + k]), action(B, backward[k])]
    row += [action(B, unit) for unit in backward[len(forward) - warmup:]]
    return tuple(row)
