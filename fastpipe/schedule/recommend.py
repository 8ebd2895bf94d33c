"""Pick a schedule: simulate every registered generator and rank by simulated makespan.

Costs here describe a *physical stage*: ``forward``, ``backward``, ``weight`` and
``activation`` are what one stage's whole slice of the model costs per
micro-batch (a number, or one per physical stage). A schedule with ``v`` chunks
per stage splits that slice evenly, so each chunk costs the stage cost divided
by ``v`` (so do its gradient ``reduction`` and ``optimizer`` step); ``p2p`` and ``send`` are
per hop and are not divided. This keeps schedules
with different ``v`` comparable: they do the same total work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

from .registry import ASYNCHRONOUS, SCHEDULES, get_schedule
from .checks import check_count
from .schedule import Schedule
from .simulator import Costs, simulate

__all__ = ["Recommendation", "recommend", "make_schedule", "per_chunk_costs"]


_SPLIT_FIELDS = ("forward", "backward", "weight", "activation", "reduction", "optimizer")


@dataclass(frozen=True)
class Recommendation:
    """One simulated candidate: schedule ``name`` with ``virtual_stages`` chunks per stage;
    ``peak_memory`` is the largest per-stage peak of in-flight activation memory."""

    name: str
    virtual_stages: int
    makespan: float
    bubble_fraction: float
    peak_memory: float


def recommend(
    stages: int,
    chunks: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    *,
    virtual_stages: Iterable[int] = (1, 2),
    schedules: Iterable[str] | None = None,
) -> list[Recommendation]:
    """Simulate each schedule (default: all registered) with each number of chunks per
    stage it supports, for ``stages`` stages and ``chunks`` micro-batches, and return
    those whose peak memory fits ``memory_limit``, fastest first.

    ``costs`` are per physical stage (see the module docstring). Combinations a
    generator rejects (``ValueError``, ``NotImplementedError``) are skipped.
    Raises ``ValueError`` when nothing fits, naming the smallest peak found.
    """
    check_count("stages", stages)
    check_count("chunks", chunks)
    names = _names(schedules)
    virtual_stages = tuple(virtual_stages)
    candidates = [
        _evaluate(name, schedule, costs or Costs())
        for name, schedule in _candidates(names, stages, chunks, virtual_stages)
    ]
    if not candidates:
        raise ValueError(
            f"none of the schedules {names} supports stages={stages}, chunks={chunks} "
            f"with virtual_stages={virtual_stages}"
        )
    return _rank(candidates, memory_limit)


def make_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Generate schedule ``name`` with ``virtual_stages`` chunks per physical stage; raises
    ``ValueError`` for a combination the generator does not support."""
    check_count("virtual_stages", virtual_stages)
    return get_schedule(name, stages, microbatches, virtual_stages=virtual_stages)


def per_chunk_costs(costs: Costs, schedule: Schedule) -> Costs:
    """Turn per-physical-stage ``costs`` into the per-virtual-stage costs the simulator
    takes: each chunk gets its stage's compute and activation divided by ``num_chunks``."""
    values = {}
    for f in fields(costs):
        value = getattr(costs, f.name)
        divisor = schedule.num_chunks if f.name in _SPLIT_FIELDS else 1
        if isinstance(value, tuple):
            per_stage = _per_stage(f.name, value, schedule.num_stages)
            value = tuple(
                per_stage[schedule.stage_of(vs)[0]] / divisor
                for vs in range(schedule.num_virtual_stages)
            )
        else:
            value = value / divisor
        values[f.name] = value
    return Costs(**values)


def _per_stage(name: str, value: Sequence[float], num_stages: int) -> Sequence[float]:
    if len(value) != num_stages:
        raise ValueError(
            f"costs.{name} has {len(value)} entries but there are {num_stages} stages; "
            "give one number or one per physical stage"
        )
    return value


def _names(schedules: Iterable[str] | None) -> list[str]:
    if schedules is None:  # asynchronous ones change the optimisation: only when asked for
        return sorted(set(SCHEDULES) - ASYNCHRONOUS)
    names = [name.lower() if isinstance(name, str) else name for name in schedules]
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown:
        valid = ", ".join(repr(n) for n in sorted(SCHEDULES))
        raise ValueError(f"unknown schedule(s) {unknown}; valid names: {valid}")
    return names


def _candidates(
    names: list[str], stages: int, chunks: int, virtual_stages: tuple[int, ...]
) -> list[tuple[str, Schedule]]:
    """Every (name, schedule) the generators accept, one per (name, chunks per stage)."""
    found: dict[tuple[str, int], Schedule] = {}
    for name in names:
        for v in virtual_stages:
            try:
                schedule = make_schedule(name, stages, chunks, v)
            except (ValueError, NotImplementedError):
                continue
            found.setdefault((name, schedule.num_chunks), schedule)
    return [(name, schedule) for (name, _), schedule in found.items()]


def _evaluate(name: str, schedule: Schedule, costs: Costs) -> Recommendation:
    result = simulate(schedule, per_chunk_costs(costs, schedule))
    return Recommendation(
        name, schedule.num_chunks, result.makespan, result.bubble_fraction,
        max(result.peak_memory, default=0.0),
    )


def _rank(candidates: list[Recommendation], memory_limit: float | None) -> list[Recommendation]:
    fits = [c for c in candidates if memory_limit is None or c.peak_memory <= memory_limit + 1e-9]
    if not fits:
        best = min(candidates, key=lambda c: c.peak_memory)
        raise ValueError(
            f"no schedule fits memory_limit={memory_limit}: the smallest peak memory found is "
            f"{best.peak_memory:g} ({best.name}, virtual_stages={best.virtual_stages})"
        )
    return sorted(fits, key=lambda c: (c.makespan, c.peak_memory, c.name, c.virtual_stages))
