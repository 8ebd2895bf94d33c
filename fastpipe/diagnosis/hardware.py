"""Stages that share the hardware they need: the bottleneck no balance can fix.

A stage overlaps its neighbours only on hardware of its own: a worker thread per CPU stage, a
core per such thread, a GPU per stage. Whether a CPU stage had its core is measured on its
thread (the CPU time it got over the wall time of its actions, ``StepContext.cpu_busy``, on
every rank of a ``DistributedPipe`` too); a trace without that falls back on the load
average, a one-minute figure that lags the machine. Where stages
share one, they run one at a time: moving layers between them moves time from one to the other,
not off the step, so balance advice is withheld for them. Where the CPU stages' intra-op threads
outnumber the cores, balance advice stands but is qualified. Read from the hardware facts a
traced step records (:class:`~fastpipe.schedule.trace_file.StepContext`). Pure Python.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..schedule.trace_file import StepContext
from .findings import Finding

__all__ = ["BUSY_CORE", "Sharing", "apply", "check"]

BUSY_CORE = 0.5
"""Load from other processes, in cores, above which the CPU stages are taken to lose a core
(read only for a trace that did not measure its stages' CPU time)."""

CONTENDED = 0.8
"""A CPU stage whose thread got less than this share of a core during its actions (CPU time
over wall time, measured on the thread) shared its core with other work."""


@dataclass(frozen=True)
class Sharing:
    """The hardware finding, and the stages for which balance advice is ``withheld``."""

    finding: Finding
    withheld: Tuple[int, ...]


def apply(found: Sequence[Finding], context: StepContext, num_stages: int) -> List[Finding]:
    """``found`` with the hardware finding first, balance advice for a stage that shares its
    hardware withheld (and chunks and schedule advice when every stage does: they ran one at a
    time, so there is no bubble to shrink), and the other layout advice qualified."""
    sharing = check(context, num_stages)
    if sharing is None:
        return list(found)
    kept = [sharing.finding]
    serial = set(range(num_stages)) <= set(sharing.withheld)  # every stage one at a time
    for finding in found:
        if finding.kind == "imbalance" and finding.stage in sharing.withheld:
            continue
        if finding.kind in ("chunks", "schedule") and serial:
            continue  # no stage overlaps another: there is no bubble to shrink
        if finding.kind in ("imbalance", "chunks", "schedule") and finding.fix:
            finding = replace(finding, fix=f"{finding.fix} (if the stages get hardware of their "
                              f"own: see the hardware finding)")
        kept.append(finding)
    return kept


def check(context: StepContext, num_stages: int) -> Optional[Sharing]:
    """The stages sharing a GPU or too few cores, from ``context``'s hardware facts."""
    return (_shared_gpus(context.devices, num_stages) or _shared_threads(context.threads)
            or _cpu_cores(context, num_stages))


def _shared_threads(threads: Optional[Sequence[Sequence[int]]]) -> Optional[Sharing]:
    """Stages on one worker thread (more CPU stages than ``cpu_workers``): one at a time."""
    shared = [tuple(group) for group in threads or () if len(group) > 1]
    if not shared:
        return None
    words = " and ".join(f"stages {', '.join(map(str, g))}" for g in shared)
    withheld = tuple(sorted(s for g in shared for s in g))
    return Sharing(Finding(
        "hardware", f"{words} shared a worker thread, so they ran one at a time: that thread "
        f"is the bottleneck", 0.0, "more CPU workers (cpu_workers=..., a core each) or fewer "
        "stages; balance advice for these stages is withheld", stage=withheld[0]), withheld)


def _shared_gpus(devices: Optional[Sequence[str]], num_stages: int) -> Optional[Sharing]:
    """Several stages on one accelerator: they run one at a time."""
    if devices is None or len(devices) != num_stages:
        return None
    stages: Dict[str, List[int]] = defaultdict(list)
    for stage, device in enumerate(devices):
        if device != "cpu":
            stages[device].append(stage)
    shared = {d: s for d, s in stages.items() if len(s) > 1}
    if not shared:
        return None
    words = "; ".join(f"stages {', '.join(map(str, s))} share {d}" for d, s in shared.items())
    withheld = tuple(sorted(x for s in shared.values() for x in s))
    return Sharing(Finding(
        "hardware", f"{words}: they run one at a time, so that device is the bottleneck", 0.0,
        "one stage per device (devices=[...] with distinct GPUs, or fewer stages); balance "
        "advice for these stages is withheld", stage=withheld[0]), withheld)


def _cpu_cores(context: StepContext, num_stages: int) -> Optional[Sharing]:
    """The CPU stages' contention: measured on their threads when the trace has it, else
    worker threads against the cores the load average leaves them; intra-op threads
    against cores."""
    measured = _measured(context, num_stages)
    if measured is not None:
        return measured or None
    cpu = _cpu_stages(context, num_stages)
    if not cpu or context.cores is None:
        return None
    workers = _workers(context.threads, cpu)
    others = max(0.0, (context.load or 0.0) - min(context.cores, workers))
    free = context.cores - (others if others > BUSY_CORE else 0.0)
    load = "" if context.load is None else f", load average {context.load:.1f}"
    if workers > free:
        return Sharing(Finding(
            "hardware", f"the CPU stages are the bottleneck: {workers} worker threads ran "
            f"them on about {max(0.0, free):.1f} free cores ({context.cores} cores{load}), so "
            f"they could not all run side by side", 0.0,
            "give each CPU stage a core of its own (a quieter machine, fewer stages, "
            "cpu_workers=...); balance advice is withheld until then", stage=cpu[0]),
            tuple(cpu))
    threads = workers * (context.intra_op_threads or 1)
    if threads <= context.cores:
        return None
    return Sharing(Finding(
        "hardware", f"{workers} CPU worker threads x {context.intra_op_threads} intra-op "
        f"threads = {threads} threads on {context.cores} cores{load}", 0.0,
        f"torch.set_num_threads({max(1, context.cores // workers)}) gives each stage its own "
        f"cores; gains predicted here assume it", stage=cpu[0]), ())


def _measured(context: StepContext, num_stages: int) -> Optional[Union[Sharing, bool]]:
    """The stages whose threads got less than :data:`CONTENDED` of a core during their
    actions; ``False`` when every stage had its core, ``None`` when not measured (or with
    several intra-op threads, whose work the stage's own thread time does not see)."""
    busy = context.cpu_busy
    if busy is None or len(busy) != num_stages or (context.intra_op_threads or 1) > 1:
        return None
    short = [s for s, share in enumerate(busy) if share < CONTENDED]
    if not short:
        return False
    shares = ", ".join(f"stage {s} {busy[s]:.0%}" for s in short)
    return Sharing(Finding(
        "hardware", f"the CPU stages lacked cores: their threads got {shares} of a core "
        f"during their actions (CPU time over wall time, measured on each thread), so other "
        f"work ran in their place", 0.0,
        "give each CPU stage a core of its own (a quieter machine, fewer stages or ranks, "
        "cpu_workers=...); balance advice for these stages is withheld until then",
        stage=short[0]), tuple(short))


def _cpu_stages(context: StepContext, num_stages: int) -> List[int]:
    """The CPU stages, when the devices are known (a ``Pipe``'s trace)."""
    if context.devices is None or len(context.devices) != num_stages:
        return []
    return [s for s, d in enumerate(context.devices) if d == "cpu"]


def _workers(threads: Optional[Sequence[Sequence[int]]], cpu: Sequence[int]) -> int:
    """Worker threads that ran CPU stages (one per CPU stage when unknown)."""
    if threads is None:
        return len(cpu)
    return sum(1 for group in threads if any(s in cpu for s in group))
