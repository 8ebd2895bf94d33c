"""The layouts worth simulating: every grid, schedule, chunk count, micro-batch size, checkpoint
mode and rank order the GPUs and the batch allow, less those that cannot fit in memory, ranked
by a closed-form estimate so that only the best few are simulated.

The estimate of a layout: its slowest stage's work per micro-batch times the micro-batches plus
the bubble the schedule leaves (``stages - 1`` chunk-slots of work for one-chunk flush
schedules, a ``1/v`` of that for ``v`` chunks, a third of it when W fills the bubble), plus
the exposed reduction and the optimizer. Its memory: each stage's static bytes plus its
heaviest chunk's activation bytes times the peak number of micro-batches the schedule keeps in
flight on that stage (counted once per schedule shape, by the simulator's memory scan of a
short run). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..schedule import ASYNCHRONOUS, SCHEDULES
from ..schedule.simulator import mode_peaks
from .costs import ChunkCosts, Work, chunk_costs, even_balance, split_weight
from .hardware import GPU
from .layout import CHECKPOINT_MODES, ORDERS, Layout
from .predict import schedule_for
from .runtime_model import Runtime

__all__ = ["Candidate", "VIRTUAL", "candidates", "divisors", "schedules_of"]

VIRTUAL = {"interleaved": (2, 3, 4, 6, 8), "looped-bfs": (2, 4), "zbv": (2,), "dualpipev": (2,)}
"""Chunks per stage each multi-chunk schedule is tried with (one-chunk schedules: 1)."""

MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch sizes (sequences) tried when the caller does not fix one."""


@dataclass(frozen=True)
class Candidate:
    """A layout with its costs, its estimated step time and memory (before simulation)."""

    layout: Layout
    costs: ChunkCosts
    estimate: float
    memory: float


def divisors(n: int) -> List[int]:
    """The divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def schedules_of(names: Optional[Sequence[str]]) -> List[str]:
    """The schedules to weigh: ``names`` checked, or every registered flush schedule."""
    if names is None:
        return sorted(set(SCHEDULES) - ASYNCHRONOUS - {"gpipe"})
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; known: {', '.join(sorted(SCHEDULES))}")
    return list(names)


def _grids(work: Work, gpus: int, per_node: int, fixed: Mapping[str, object]
           ) -> Iterator[Tuple[int, int, int, int]]:
    """(tensor, pipeline, data, shard) that multiply to ``gpus``: tensor inside a node and a
    divisor of the heads, at most one stage per layer plus the embedding and head."""
    model = work.model
    for t in divisors(gpus):
        if t > per_node or model.heads % t or not _allowed(fixed, "tensor", t):
            continue
        for p in divisors(gpus // t):
            if p > model.layers + 2 or not _allowed(fixed, "pipeline", p):
                continue
            replicas = gpus // (t * p)
            if not _allowed(fixed, "replicas", replicas):
                continue
            for data, shard in ((replicas, 1), (1, replicas)):
                if _allowed(fixed, "data", data) and _allowed(fixed, "shard", shard):
                    yield t, p, data, shard
                if replicas == 1:
                    break


def _allowed(fixed: Mapping[str, object], name: str, value: object) -> bool:
    """Whether ``value`` is allowed for ``name``: any when not fixed, else the fixed value
    (or one of a fixed tuple of values)."""
    if fixed.get(name) is None:
        return True
    want = fixed[name]
    return value in want if isinstance(want, (tuple, list, frozenset, set)) else value == want


def candidates(work: Work, gpus: int, gpu: GPU, rt: Runtime, *, per_node: int,
               memory: float, schedules: Sequence[str], fixed: Mapping[str, object],
               balance: str = "even") -> Tuple[List[Candidate], Dict[str, int]]:
    """Every layout that fits ``memory`` bytes per GPU, best estimate first, and the counts
    of layouts considered and dropped (``{'considered': .., 'memory': .., ...}``); when
    none fits, those of least memory."""
    counts = {"considered": 0, "memory": 0}
    fits: List[Candidate] = []
    spill: List[Candidate] = []
    for layout in _layouts(work, gpus, schedules, fixed, per_node, balance):
        counts["considered"] += 1
        found = _candidate(work, layout, gpu, rt, per_node)
        if found is None:
            continue
        if found.memory <= memory:
            fits.append(found)
        else:
            counts["memory"] += 1
            spill.append(found)
    chosen = fits or sorted(spill, key=lambda c: c.memory)[:8]
    return sorted(chosen, key=lambda c: c.estimate), counts


def _layouts(work: Work, gpus: int, schedules: Sequence[str], fixed: Mapping[str, object],
             per_node: int, balance: str) -> Iterator[Layout]:
    batch = work.global_batch
    for t, p, data, shard in _grids(work, gpus, per_node, fixed):
        replicas = data * shard
        if batch % replicas:
            continue
        for b in _micro_batches(batch // replicas, fixed):
            m = batch // (replicas * b)
            for name, v in _schedules(schedules, p, m, work.model.layers, fixed):
                for mode in CHECKPOINT_MODES:
                    if not _allowed(fixed, "checkpoint", mode):
                        continue
                    for order in _orders(t, p, data, shard, per_node, fixed):
                        layout = Layout(t, p, data, shard, v, name, b, mode, order)
                        yield layout.with_changes(
                            balance=_balance(work, layout, balance, fixed))


def _micro_batches(per_replica: int, fixed: Mapping[str, object]) -> List[int]:
    """Micro-batch sizes that divide each replica's share of the batch."""
    sizes = _as_tuple(fixed["micro_batch"]) if fixed.get("micro_batch") else MICRO_BATCHES
    return [b for b in sizes if per_replica % b == 0]


def _as_tuple(value: object) -> Tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)  # type: ignore


def _schedules(schedules: Sequence[str], p: int, m: int, layers: int,
               fixed: Mapping[str, object]) -> Iterator[Tuple[str, int]]:
    """(schedule, chunks per stage) the sizes allow; one pipeline stage runs '1f1b' only
    (every schedule is the same there)."""
    if p == 1:
        if _allowed(fixed, "virtual", 1):
            yield "1f1b", 1
        return
    for name in schedules:
        if not _allowed(fixed, "schedule", name):
            continue
        tried = _as_tuple(fixed["virtual"]) if fixed.get("virtual") else VIRTUAL.get(name, (1,))
        for v in tried:
            if p * v > layers + 2 or (v > 1 and name == "interleaved" and m % p):
                continue
            if _generates(name, p, m, v):
                yield name, v


def _short(p: int, m: int, v: int) -> int:
    """Micro-batches of the short run that stands for a step (in-flight counts saturate)."""
    return min(m, p * (v + 2))


@lru_cache(maxsize=4096)
def _generates(name: str, p: int, m: int, v: int) -> bool:
    try:
        schedule_for(name, p, _short(p, m, v), v)
    except (ValueError, NotImplementedError):
        return False
    return True


def _orders(t: int, p: int, data: int, shard: int, per_node: int,
            fixed: Mapping[str, object]) -> List[str]:
    """The rank orders that differ in which groups stay inside a node."""
    seen, out = set(), []
    for order in ORDERS:
        if not _allowed(fixed, "order", order):
            continue
        layout = Layout(t, p, data, shard, order=order)
        key = tuple(layout.inside_node(d, per_node) for d in ("tensor", "pipeline", "data",
                                                               "shard"))
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def _balance(work: Work, layout: Layout, rule: str, fixed: Mapping[str, object]
             ) -> Tuple[int, ...]:
    """Layers per virtual stage: ``'even'``, or ``'lighter-ends'`` (one fewer on the chunks
    that also run the embedding and the head)."""
    if fixed.get("balance") is not None and not isinstance(fixed["balance"], str):
        return tuple(fixed["balance"])  # type: ignore[arg-type]
    rule = str(fixed.get("balance") or rule)
    return even_balance(work.model.layers, layout.virtual_stages, rule == "lighter-ends")


def _candidate(work: Work, layout: Layout, gpu: GPU, rt: Runtime,
               per_node: int) -> Optional[Candidate]:
    try:
        costs = chunk_costs(work, layout, gpu, rt, per_node)
    except ValueError:
        return None
    m = layout.microbatches(work.global_batch)
    memory = _memory(costs, layout, m)
    return Candidate(layout, costs, _estimate(costs, layout, m), memory)


def _estimate(costs: ChunkCosts, layout: Layout, m: int) -> float:
    """The closed-form step time of the module docstring."""
    work = [f + b + w + s for f, b, w, s in zip(costs.forward, costs.backward, costs.weight,
                                                costs.send)]
    stages = [sum(work[_chunk(layout, s, k)] for k in range(layout.virtual))
              for s in range(layout.pipeline)]
    bubble = (layout.pipeline - 1) * max(work) * (1 / 3 if split_weight(layout) else 1.0)
    tail = max(costs.optimizer) * layout.virtual + max(costs.reduction)
    return m * max(stages) + bubble + tail


def _chunk(layout: Layout, stage: int, chunk: int) -> int:
    if layout.schedule in ("zbv", "dualpipev") and layout.virtual == 2:
        return stage if chunk == 0 else 2 * layout.pipeline - 1 - stage
    return chunk * layout.pipeline + stage


def _memory(costs: ChunkCosts, layout: Layout, m: int) -> float:
    """The most bytes a stage holds: static, plus in-flight micro-batches times the heaviest
    chunk's activation bytes (the inputs of checkpointed ones included)."""
    units = _in_flight(layout.schedule, layout.pipeline,
                       _short(layout.pipeline, m, layout.virtual), layout.virtual)
    worst = 0.0
    for stage in range(layout.pipeline):
        chunks = [_chunk(layout, stage, k) for k in range(layout.virtual)]
        held = max(costs.held[v] for v in chunks)
        kept = max(costs.inputs[v] for v in chunks) if layout.checkpoint == "always" else 0.0
        worst = max(worst, costs.static[stage] + units[stage] * (kept if kept else held)
                    + (held if kept else 0.0))
    return worst


@lru_cache(maxsize=4096)
def _in_flight(name: str, p: int, m: int, v: int) -> Tuple[float, ...]:
    """Per stage, the peak (chunk, micro-batch) pairs held (checkpointed ones: their inputs)."""
    schedule = schedule_for(name, p, m, v)
    return mode_peaks(schedule, "never")
