"""A front door's checked constructor arguments, frozen: the ``Layout``, and its schedules.

Every argument is checked here before any work, each with a typed error naming it; the first
step's schedule and micro-batch count follow from the layout alone (``first_schedule``), so a
schedule that cannot run the layout raises before any stage is built.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from ..autotune import chunk_count, schedule_choice
from ..placement import check_chunks, check_flag, check_timeout, resolve_virtual_stages
from ..policies import selective
from ..policies.checkpoint import check_mode
from ..schedule import Schedule, get_schedule


@dataclass(frozen=True)
class Layout:
    """A front door's checked arguments, fixed at construction: what the pipeline is."""

    chunks: int  # the requested micro-batch count (the first candidate with chunks='auto')
    auto_chunks: bool
    checkpoint: str
    schedule: str  # the requested schedule name, 'auto' included
    virtual_stages: int
    timeout: float
    deferred_batch_norm: bool
    balance: Tuple[int, ...] = ()
    fixed: Optional[Schedule] = None  # a Schedule given as schedule=: runs as given

    @property
    def auto_schedule(self) -> bool:
        return self.schedule == "auto" and self.fixed is None

    @property
    def first_schedule(self) -> str:
        """The schedule of the first step (``'auto'`` starts with 1F1B or looped BFS)."""
        if self.auto_schedule:
            return schedule_choice.first_schedule(self.virtual_stages)
        return self.schedule

    def with_balance(self, balance: Sequence[int]) -> "Layout":
        return dataclasses.replace(self, balance=tuple(balance))


def parse_layout(chunks: Any, checkpoint: Any, schedule: Any, virtual_stages: Any,
                 timeout: Any, deferred_batch_norm: Any) -> Layout:
    """The arguments both front doors take, checked (a typed error naming the argument)."""
    auto_chunks = isinstance(chunks, str) and chunks == "auto"
    fixed = check_fixed(schedule, chunks, virtual_stages) if isinstance(schedule, Schedule) \
        else None
    return Layout(chunks=1 if auto_chunks else check_chunks(chunks), auto_chunks=auto_chunks,
                  checkpoint=check_checkpoint(checkpoint),
                  schedule=fixed.name if fixed else schedule_choice.check_name(schedule),
                  virtual_stages=resolve_virtual_stages(virtual_stages, schedule),
                  timeout=check_timeout(timeout),
                  deferred_batch_norm=check_flag(deferred_batch_norm, "deferred_batch_norm"),
                  fixed=fixed)


def check_fixed(schedule: Schedule, chunks: Any, virtual_stages: Any) -> Schedule:
    """A ``Schedule`` given as ``schedule=`` (e.g. ``fastpipe.schedule.read_csv``), checked
    against ``chunks`` and ``virtual_stages``: it runs its own micro-batch count and chunks."""
    m, v = schedule.num_microbatches, schedule.num_chunks
    if chunks != m or isinstance(chunks, bool):
        raise ValueError(f"chunks={chunks!r}, but the Schedule given as schedule= runs {m} "
                         f"micro-batches; pass chunks={m}")
    if virtual_stages is not None and virtual_stages != v:
        raise ValueError(f"virtual_stages={virtual_stages!r}, but the Schedule given as "
                         f"schedule= places {v} chunks per stage; pass virtual_stages={v} or "
                         f"leave it out")
    return schedule


def check_checkpoint(mode: Any) -> str:
    """The checkpoint mode, checked; its one-time set-up (imports torch's selective-checkpoint
    machinery) happens here, so that the first step's timeout measures the step alone."""
    mode = check_mode(mode)
    if mode == selective.MODE:
        selective.prepare()
    return mode


@functools.lru_cache(maxsize=64)
def validated_schedule(name: Union[str, Schedule], num_stages: int, num_microbatches: int,
                       virtual_stages: int) -> Schedule:
    """The named schedule for a layout, validated once (cached) for buffered sends: both
    executors buffer every send (mailboxes, non-blocking p2p). A ``Schedule`` given as
    ``schedule=`` is the schedule itself, for its own sizes only."""
    if isinstance(name, Schedule):
        return _fixed_sizes(name, num_stages, num_microbatches, virtual_stages)
    schedule = get_schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)
    schedule.validate(comm="buffered")
    return schedule


def first_schedule(layout: Layout, num_stages: int) -> Tuple[int, Schedule]:
    """The first step's micro-batch count (with ``chunks='auto'``, the search's first
    candidate the schedule accepts) and its validated schedule on ``num_stages`` physical
    stages; raises for a schedule that cannot run the layout."""
    def plan(count: int) -> Schedule:
        return validated_schedule(layout.fixed or layout.first_schedule, num_stages, count,
                                  layout.virtual_stages)

    chunks = layout.chunks
    if layout.auto_chunks:
        chunks = chunk_count.first_count(num_stages, lambda m: chunk_count.accepted(plan, m))
    return chunks, plan(chunks)


def _fixed_sizes(schedule: Schedule, num_stages: int, num_microbatches: int,
                 virtual_stages: int) -> Schedule:
    """A given ``Schedule`` for a pipe of these sizes, validated; ``ValueError`` for others (a
    short batch's fewer micro-batches included)."""
    have = (schedule.num_stages, schedule.num_microbatches, schedule.num_chunks)
    if have != (num_stages, num_microbatches, virtual_stages):
        raise ValueError(f"the Schedule given as schedule= ({schedule.name!r}) runs {have[0]} "
                         f"stages, {have[1]} micro-batches and {have[2]} chunks per stage; this "
                         f"pipe needs {num_stages}, {num_microbatches} and {virtual_stages} "
                         f"(a batch too short for {have[1]} micro-batches cannot run it)")
    schedule.validate(comm="buffered")
    return schedule
