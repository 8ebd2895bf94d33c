"""Generation as one forward pass: the decode schedule.

Generating ``steps`` tokens with a model cut into ``K`` virtual stages is a forward pass through
``steps * K`` virtual stages: virtual stage ``t * K + k`` is model stage ``k`` at iteration
``t`` (iteration 0 reads the prompt, every later one the token sampled before it), placed where
the pipeline places model stage ``k``. The activation edge from the last model stage of
iteration ``t`` to the first model stage of iteration ``t + 1`` is the *token edge*: the sampled
token travels from the last physical stage back to the first as an ordinary activation. The
micro-batches are the groups of sequences in flight, each with its own cache on every stage.

Nothing else is new: the dependency rule, the lowering (in-process, tagged p2p, NCCL groups) and
the validator's deadlock models apply to this schedule as they are. Each stage runs its forwards
in (virtual stage, micro-batch) order, looped BFS's forward order: while one group's token
travels back to the first stage, the stages work on the other groups, so ``num_stages`` groups
keep every stage busy. :func:`validate_decode` checks what ``Schedule.validate`` checks, for a
forward-only schedule.
"""

from __future__ import annotations

from collections import Counter

from .actions import Action, ActionKind, F, gc_paused
from .checks import ScheduleError, check_count
from .ir import Placement
from .lockstep import COMM_MODELS, run_lockstep
from .lower import lower
from .nccl import lower_nccl
from .schedule import Schedule
from .validate import ValidationReport

__all__ = ["decode", "unrolled_placement", "validate_decode", "model_stage", "iteration"]


def unrolled_placement(placement: Placement, steps: int) -> Placement:
    """``placement`` (a pipeline's: ``placement[stage][chunk]`` is a model virtual stage)
    repeated for ``steps`` iterations: chunk ``t * v + j`` of a stage holds virtual stage
    ``t * K + placement[stage][j]``, ``K`` being the model's virtual stage count."""
    check_count("steps", steps)
    table = tuple(tuple(row) for row in placement)
    count = sum(len(row) for row in table)
    return tuple(tuple(t * count + vs for t in range(steps) for vs in row) for row in table)


def model_stage(virtual_stage: int, model_stages: int) -> int:
    """The model virtual stage that unrolled ``virtual_stage`` runs."""
    return virtual_stage % model_stages


def iteration(virtual_stage: int, model_stages: int) -> int:
    """The iteration (0: the prompt) that unrolled ``virtual_stage`` belongs to."""
    return virtual_stage // model_stages


@gc_paused()
def decode(num_stages: int, num_microbatches: int, steps: int,
           placement: Placement | None = None) -> Schedule:
    """The decode schedule: ``num_microbatches`` groups of sequences, ``steps`` forwards each
    (the prompt, then one per new token but the last), through a pipeline of ``num_stages``
    physical stages placed as ``placement`` (default: one model stage per physical stage).

    Each stage runs its forwards in (virtual stage, micro-batch) order. Validate it with
    :func:`validate_decode`; ``Schedule.validate`` expects backwards.
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    check_count("steps", steps)
    base = placement if placement is not None else tuple((s,) for s in range(p))
    if len(base) != p or len({len(row) for row in base}) != 1:
        raise ScheduleError(f"placement must have {p} rows (one per stage) of equal length, "
                            f"got {base}")
    table = unrolled_placement(base, steps)
    rows = tuple(_row(stage, table[stage], m) for stage in range(p))
    return Schedule("decode", p, m, rows, num_chunks=len(table[0]), placement=table)


def _row(stage: int, chunks: tuple[int, ...], m: int) -> tuple[Action, ...]:
    order = sorted((vs, mb, chunk) for chunk, vs in enumerate(chunks) for mb in range(m))
    return tuple(Action(stage, F, mb, chunk) for _, mb, chunk in order)


def validate_decode(schedule: Schedule, *, comm: str = "buffered") -> ValidationReport:
    """Check a forward-only schedule: every (virtual stage, micro-batch) has exactly one forward
    and nothing else, each stage runs a forward after the forwards on it that it depends on,
    and the lowered programs cannot deadlock under ``comm`` (``"buffered"``, ``"rendezvous"``
    or ``"nccl"``, whose programs are :func:`fastpipe.schedule.lower_nccl`'s). Raises
    :class:`ScheduleError` naming the stage and action; returns the report of the run (its
    ``peak_inflight``: the groups in flight, whose caches every stage holds throughout)."""
    if comm not in COMM_MODELS:
        valid = ", ".join(repr(c) for c in COMM_MODELS)
        raise ValueError(f"comm={comm!r} is not a deadlock model; valid: {valid}")
    with gc_paused():
        _check_forwards(schedule)
        _check_order(schedule)
        programs = lower_nccl(schedule) if comm == "nccl" else lower(schedule)
        steps = run_lockstep(schedule, programs, comm=comm)
    groups = tuple(schedule.num_microbatches for _ in schedule.actions)  # all in flight
    last = max((row[-1] + 1 for row in steps if row), default=0)
    return ValidationReport(groups, last, steps)


def _check_forwards(schedule: Schedule) -> None:
    m, v = schedule.num_microbatches, schedule.num_chunks
    for stage, row in enumerate(schedule.actions):
        counts = Counter(row)
        for position, action in enumerate(row):
            if action.kind is not ActionKind.FORWARD:
                raise ScheduleError(f"stage {stage}: action {action} at position {position} is "
                                    f"not a forward; a decode schedule runs forwards only")
            if action.microbatch >= m or action.chunk >= v:
                raise ScheduleError(f"stage {stage}: action {action} at position {position} is "
                                    f"out of range (micro-batches 0..{m - 1}, chunks 0..{v - 1})")
            if counts[action] > 1:
                raise ScheduleError(f"stage {stage}: action {action} appears {counts[action]} "
                                    f"times; it must run once")
        if len(counts) != m * v:
            missing = next(Action(stage, F, mb, c) for c in range(v) for mb in range(m)
                           if Action(stage, F, mb, c) not in counts)
            raise ScheduleError(f"stage {stage}: micro-batch {missing.microbatch} of chunk "
                                f"{missing.chunk} has no forward; expected action {missing}")


def _check_order(schedule: Schedule) -> None:
    for stage, row in enumerate(schedule.actions):
        position = {action: i for i, action in enumerate(row)}
        for i, action in enumerate(row):
            for dep in schedule.dependencies(action):
                if dep.stage == stage and position.get(dep, -1) > i:
                    raise ScheduleError(
                        f"stage {stage}: action {action} (micro-batch {action.microbatch}) at "
                        f"position {i} runs before {dep} at position {position[dep]}, whose "
                        f"output it takes (the token or activation of the iteration before)")
