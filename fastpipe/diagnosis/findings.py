"""What to change, with the number behind it: findings ranked by expected gain.

Each finding predicts its gain with the simulator on the measured costs (new balance from the
partition solver, another micro-batch count, another schedule from ``recommend``) or reads it
off the step's split (input, communication, unexplained). A finding is kept when it promises at
least :data:`MIN_GAIN` of the step, so a balanced, well-sized pipe gets none. Pure Python.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

from .. import balance as partition
from ..schedule.trace_file import StepContext
from .layers import costs_for, layer_costs
from .split import Split, stage_work
from ..schedule import ASYNCHRONOUS
from ..schedule.schedule import Schedule
from ..schedule.recommend import make_schedule, recommend
from ..schedule.simulator import (CHECKPOINTED, Costs, checkpointed_count, mode_peaks,
                                  simulate)

__all__ = ["Finding", "Memory", "MIN_GAIN", "find"]

MIN_GAIN = 0.05
"""Smallest expected gain, as a share of the step, for a finding to be reported."""

SCHEDULE_GAIN = 0.10
"""A schedule change must promise more: a full backward's split into input- and weight-gradient
halves is assumed, not measured."""
COMMUNICATION_SHARE = 0.10
UNEXPLAINED_SHARE = 0.15
HEADROOM_USED = 0.5  # checkpointing below this share of memory is recomputation to spare
MEMORY_FULL = 0.9


@dataclass(frozen=True)
class Memory:
    """Per stage: peak bytes (CUDA ``max_memory_allocated`` or saved-activation bytes) and,
    where known, the bytes it may use (the device's capacity, or a budget)."""

    peak: Tuple[float, ...]
    limit: Optional[Tuple[float, ...]] = None


@dataclass(frozen=True)
class Finding:
    """One problem: ``kind`` (``'imbalance'``, ``'chunks'``, ``'schedule'``, ``'input'``,
    ``'communication'``, ``'unexplained'``, ``'memory'``, ``'hardware'``), what was measured,
    what to change, and the expected gain in seconds per step (0 for a risk or a hardware
    fact rather than a speed-up); ``confidence`` (``'high'``, ``'medium'``, ``'low'``) and
    the ``evidence`` for it: the gain against the traced steps' spread
    (:mod:`fastpipe.diagnosis.confidence`)."""

    kind: str
    message: str
    gain: float
    fix: Optional[str] = None
    stage: Optional[int] = None
    balance: Optional[Tuple[int, ...]] = None
    chunks: Optional[int] = None
    schedule: Optional[str] = None
    confidence: Optional[str] = None
    evidence: Optional[str] = None


def find(split: Split, context: StepContext, memory: Optional[Memory] = None) -> List[Finding]:
    """Every finding worth reporting, largest expected gain first."""
    checks: Sequence[Callable[[], Optional[Finding]]] = (
        lambda: _imbalance(split, context), lambda: _chunks(split, context),
        lambda: _schedule(split, context, memory), lambda: _input(split),
        lambda: _share_finding(split, "communication", COMMUNICATION_SHARE, _COMMUNICATION),
        lambda: _share_finding(split, "unexplained", UNEXPLAINED_SHARE,
                               (_UNEXPLAINED[0], _shared_threads(context) or _UNEXPLAINED[1]),
                               explained=_overhead_per_stage(split, context)),
        lambda: _memory(split, context, memory))
    found = [f for f in (check() for check in checks) if f is not None]
    return sorted(found, key=lambda f: -f.gain)


def _worth(split: Split, gain: float) -> bool:
    return gain >= MIN_GAIN * split.step_time


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _pct(split: Split, seconds: float) -> str:
    return f"{seconds / split.step_time:.0%}" if split.step_time > 0 else "0%"


# -------------------------------------------------------------------------------- imbalance
def _imbalance(split: Split, context: StepContext) -> Optional[Finding]:
    """The slowest stage, and the balance the partition solver finds from per-layer costs."""
    work = stage_work(split.costs, split.schedule)
    slowest = max(range(len(work)), key=work.__getitem__)
    others = [w for s, w in enumerate(work) if s != slowest]
    typical = statistics.median(others) if others else work[slowest]
    ratio = f"{work[slowest] / typical:.1f}x" if typical > 0 else "far above"
    waste = sum(row["imbalance"] for row in split.seconds) / len(split.seconds)
    what = (f"stage {slowest} is the slowest ({ratio} the other stages' median): imbalance "
            f"idles the others {_pct(split, waste)} of the step")
    virtual = split.schedule.num_virtual_stages
    known = context.balance is not None and len(context.balance) == virtual
    if known:
        layers = layer_costs(split.costs, split.schedule, context.balance, context.layer_costs)
        proposed = tuple(partition.solve([sum(c) for c in layers], len(context.balance)))
        if proposed != tuple(context.balance):
            predicted = simulate(split.schedule, costs_for(layers, proposed)).makespan
            gain = split.simulated - predicted
            return Finding("imbalance", what, gain, f"balance={list(proposed)} predicts "
                           f"{_ms(predicted)} instead of {_ms(split.simulated)} per step "
                           f"{_layers_from(context)}", stage=slowest,
                           balance=proposed) if _worth(split, gain) else None
    gain = split.simulated - split.equalized
    if not _worth(split, gain):
        return None
    fix = ("no split into whole layers is better: split its slowest layer, or give it a faster "
           "device" if known else "move layers away from it (pass balance=...)")
    return Finding("imbalance", what, gain, fix, stage=slowest)


def _layers_from(context: StepContext) -> str:
    """Where the per-layer costs behind a balance come from."""
    if context.layer_costs is not None:
        return "(each stage's time split over its layers by the layer profile)"
    return ("(each stage's time spread evenly over its layers; pass layer_costs= a per-layer "
            "profile when they differ)")


# -------------------------------------------------------------------------------- chunks
def _chunks(split: Split, context: StepContext) -> Optional[Finding]:
    """Another micro-batch count: each action's work scales with its micro-batch, its fixed
    cost (the gaps between ready actions, plus ``context.action_overhead``) does not."""
    schedule = split.schedule
    m = schedule.num_microbatches
    overhead = _overhead(split, context)
    base = simulate(schedule, _scaled(split.costs, 1.0, overhead)).makespan
    best: Tuple[float, int] = (base, m)
    for candidate in (m // 4, m // 2, 2 * m, 4 * m):
        other = _other_count(schedule, candidate, context)
        if other is not None:
            costs = _scaled(split.costs, m / candidate, overhead)
            best = min(best, (simulate(other, costs).makespan, candidate))
    predicted, chunks = best
    gain = base - predicted
    if chunks == m or not _worth(split, gain):
        return None
    if chunks > m:
        bubble = sum(row["inherent"] for row in split.seconds) / len(split.seconds)
        what = (f"too few micro-batches: the schedule's own bubble is {_pct(split, bubble)} "
                f"of the step with chunks={m}")
    else:
        share = _overhead_per_stage(split, context)
        what = (f"micro-batches too small: fixed per-action cost ({overhead * 1e6:.0f} us per "
                f"action) is {_pct(split, share)} of the step with chunks={m}")
    caveat = ("; this assumes an action's time shrinks in proportion to its micro-batch: "
              "small micro-batches (a few samples) make matrix products less efficient, "
              "so measure" if chunks > m else "")
    return Finding("chunks", what, gain, f"chunks={chunks} predicts {_ms(predicted)} instead of "
                   f"{_ms(base)} per step{caveat}", chunks=chunks)


def _overhead_per_stage(split: Split, context: StepContext) -> float:
    """Seconds per stage that the fixed per-action cost accounts for."""
    actions = sum(len(row) for row in split.schedule.actions) / split.schedule.num_stages
    return _overhead(split, context) * actions


def _overhead(split: Split, context: StepContext) -> float:
    gaps = statistics.median(split.dispatch_gaps) if split.dispatch_gaps else 0.0
    return gaps + (context.action_overhead or 0.0)


def _scaled(costs: Costs, factor: float, overhead: float) -> Costs:
    """Compute scaled by ``factor`` (per-micro-batch work), plus a fixed ``overhead`` per
    action (F, B; and W when the schedule has one)."""
    def scale(value: float | Tuple[float, ...], fixed: float) -> Tuple[float, ...]:
        values = value if isinstance(value, tuple) else (value,)
        return tuple(v * factor + (fixed if v > 0 else 0.0) for v in values)
    return replace(costs, forward=scale(costs.forward, overhead),
                   backward=scale(costs.backward, overhead),
                   weight=scale(costs.weight, overhead))


def _other_count(schedule: Schedule, count: int, context: StepContext) -> Optional[Schedule]:
    """The same schedule for ``count`` micro-batches, if the batch allows and it generates."""
    if count < 1 or count == schedule.num_microbatches:
        return None
    if context.samples is not None and count > context.samples:
        return None
    try:
        return make_schedule(schedule.name, schedule.num_stages, count, schedule.num_chunks)
    except (ValueError, NotImplementedError, KeyError):
        return None


# -------------------------------------------------------------------------------- schedule
def _schedule(split: Split, context: StepContext, memory: Optional[Memory]) -> Optional[Finding]:
    """A schedule ``recommend`` predicts faster for these costs, needing no more activation
    memory than the current one unless the memory stats show headroom."""
    current = split.schedule
    if current.name in ASYNCHRONOUS:
        return None
    work = _physical_costs(split.costs, current)
    try:
        ranking = recommend(current.num_stages, current.num_microbatches, work,
                            virtual_stages=(current.num_chunks,))
    except ValueError:
        return None
    mine = [r for r in ranking if r.name == current.name]
    if not mine:
        return None
    limit = mine[0].peak_memory * _headroom(memory)
    fits = [r for r in ranking if r.peak_memory <= limit + 1e-9]
    best = fits[0] if fits else mine[0]
    gain = (mine[0].makespan - best.makespan)
    if best.name == current.name or gain < SCHEDULE_GAIN * split.step_time:
        return None
    memory_words = ("with no more activation memory" if best.peak_memory <= mine[0].peak_memory
                    + 1e-9 else "within the memory headroom")
    return Finding("schedule", f"schedule {current.name!r}: the simulator predicts "
                   f"{_ms(mine[0].makespan)} for these costs", gain,
                   f"schedule={best.name!r} predicts {_ms(best.makespan)} (bubble "
                   f"{best.bubble_fraction:.0%}) {memory_words}", schedule=best.name)


def _physical_costs(costs: Costs, schedule: Schedule) -> Costs:
    """Per physical stage costs as ``recommend`` takes them; a full backward (no W measured)
    is split evenly into input- and weight-gradient halves, as ``schedule='auto'`` does."""
    n = schedule.num_virtual_stages
    f, b, w = (costs.per_virtual_stage(k, n) for k in ("forward", "backward", "weight"))
    rows = schedule.placement
    forward = [sum(f[v] for v in row) for row in rows]
    backward = [sum(b[v] + w[v] for v in row) for row in rows]
    weights = [sum(w[v] for v in row) for row in rows]
    if not any(weights):
        return Costs(forward=forward, backward=[x / 2 for x in backward],
                     weight=[x / 2 for x in backward])
    return Costs(forward=forward, backward=[x - y for x, y in zip(backward, weights)],
                 weight=weights)


def _headroom(memory: Optional[Memory]) -> float:
    """How much more activation memory than now a schedule may use: none unless limits are
    known, then the smallest limit / peak ratio over stages (activations only grow the peak)."""
    if memory is None or memory.limit is None:
        return 1.0
    ratios = [limit / peak for peak, limit in zip(memory.peak, memory.limit) if peak > 0]
    return max(1.0, min(ratios)) if ratios else 1.0


# -------------------------------------------------------------------------------- input
def _input(split: Split) -> Optional[Finding]:
    waited = split.seconds[0]["input"]
    if not _worth(split, waited):
        return None
    return Finding("input", f"input-bound: {_ms(waited)} ({_pct(split, waited)} of the step) "
                   f"pass between steps (data loading and the caller's work)", waited,
                   "load the next batch while this step runs: DataLoader(num_workers=..., "
                   "pin_memory=True, prefetch_factor=...), and move slow preprocessing off the "
                   "training loop")


_COMMUNICATION = ("waiting on transfers between stages",
                  "profile them (NCCL or gloo sends across processes, device copies, hand-offs "
                  "between threads on a busy CPU); fewer, larger micro-batches mean fewer of them")
_UNEXPLAINED = ("stages idle with their inputs ready",
                "runtime overhead or CPU contention: give each stage a free core, or run fewer, "
                "larger actions")


def _shared_threads(context: StepContext) -> Optional[str]:
    """Advice when CPU stages shared worker threads (they then never overlap)."""
    shared = [group for group in context.threads or () if len(group) > 1]
    if not shared:
        return None
    names = " and ".join("-".join(map(str, (group[0], group[-1]))) for group in shared)
    return (f"stages {names} each shared a worker thread, so ran one at a time (a thread per "
            f"core, or one for short actions): more cores or fewer stages let them overlap")


def _share_finding(split: Split, category: str, threshold: float, words: Tuple[str, str],
                   explained: float = 0.0) -> Optional[Finding]:
    """A finding for a large ``category``, less the seconds per stage another finding already
    ``explained`` (the per-action overhead the chunks advice accounts for)."""
    share = split.share(category)
    mean = share * split.step_time - explained
    if share < threshold or not _worth(split, mean):
        return None
    worst = max(range(len(split.seconds)), key=lambda s: split.seconds[s][category])
    return Finding(category, f"{words[0]}: {share:.0%} of stage-time (most on stage {worst})",
                   mean, words[1], stage=worst)


# -------------------------------------------------------------------------------- memory
def _memory(split: Split, context: StepContext, memory: Optional[Memory]) -> Optional[Finding]:
    """Checkpointing with memory to spare costs a recomputation; no checkpointing near the limit
    risks running out. Another mode's peak is predicted with the activation memory model
    (``mode_peaks``): the measured peak scaled by the modelled ratio, an upper bound for a
    lighter mode (the measured peak also holds weights, which do not scale)."""
    if memory is None or memory.limit is None or context.checkpoint is None:
        return None
    used = [p / limit if limit > 0 else 0.0 for p, limit in zip(memory.peak, memory.limit)]
    if not any(limit > 0 for limit in memory.limit):
        return None
    mode, fullest = context.checkpoint, max(range(len(used)), key=used.__getitem__)
    base = mode_peaks(split.schedule, mode) if mode in CHECKPOINTED else None
    def use(other: str) -> float:  # the fullest stage's predicted share under ``other``
        ratios = [r / b if b > 0 else 1.0 for r, b in zip(mode_peaks(split.schedule, other), base)]
        return max(u * r for u, r in zip(used, ratios))
    if mode in ("always", "except_last") and max(used) < HEADROOM_USED:
        lighter = [m for m in ("never", "except_last") if m != mode and use(m) < MEMORY_FULL]
        if not lighter:
            return None
        gain = _recompute_gain(split, mode) - _recompute_gain(split, lighter[0])
        if not _worth(split, gain):
            return None
        return Finding("memory", f"checkpoint={mode!r} recomputes forwards while the fullest "
                       f"stage uses {max(used):.0%} of its memory", gain,
                       f"checkpoint={lighter[0]!r} skips "
                       f"{'the' if lighter[0] == 'never' else 'some'} recomputation, predicted "
                       f"to peak at {use(lighter[0]):.0%}",
                       stage=fullest)
    if mode == "never" and max(used) >= MEMORY_FULL:
        options = ", ".join(f"checkpoint={m!r} predicts {use(m):.0%}" for m in
                            ("except_last", "always"))
        return Finding("memory", f"stage {fullest} peaks at {max(used):.0%} of its memory with "
                       f"checkpoint='never'", 0.0, f"{options} (each checkpointed micro-batch "
                       f"keeps only its input until its backward)", stage=fullest)
    return None


def _recompute_gain(split: Split, mode: str) -> float:
    """The step time the recomputation costs: re-simulate with each checkpointed backward
    shortened by its forward (the share of micro-batches ``mode`` recomputes)."""
    m = split.schedule.num_microbatches
    share = checkpointed_count(mode, m) / m
    if share == 0:
        return 0.0
    n = split.schedule.num_virtual_stages
    forward = split.costs.per_virtual_stage("forward", n)
    backward = split.costs.per_virtual_stage("backward", n)
    lighter = replace(split.costs, backward=tuple(max(0.0, b - share * f)
                                                  for b, f in zip(backward, forward)))
    return split.simulated - simulate(split.schedule, lighter).makespan
