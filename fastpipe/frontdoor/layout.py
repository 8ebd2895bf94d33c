"""A front door's checked constructor arguments, frozen: the ``Layout``, and its schedules.

Every argument is checked here before any work, each with a typed error naming it; the first
step's schedule and micro-batch count follow from the layout alone (``first_schedule``), so a
schedule that cannot run the layout raises before any stage is built.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

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

    @property
    def auto_schedule(self) -> bool:
        return self.schedule == "auto"

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
    return Layout(chunks=1 if auto_chunks else check_chunks(chunks), auto_chunks=auto_chunks,
                  checkpoint=check_checkpoint(checkpoint),
                  schedule=schedule_choice.check_name(schedule),
                  virtual_stages=resolve_virtual_stages(virtual_stages, schedule),
                  timeout=check_timeout(timeout),
                  deferred_batch_norm=check_flag(deferred_batch_norm, "deferred_batch_norm"))


def check_checkpoint(mode: Any) -> str:
    """The checkpoint mode, checked; its one-time set-up (imports torch's selective-checkpoint
    machinery) happens here, so that the first step's timeout measures the step alone."""
    mode = check_mode(mode)
    if mode == selective.MODE:
        selective.prepare()
    return mode


@functools.lru_cache(maxsize=64)
def validated_schedule(name: str, num_stages: int, num_microbatches: int,
                       virtual_stages: int) -> Schedule:
    """The named schedule for a layout, validated once (cached) for buffered sends: both
    executors buffer every send (mailboxes, non-blocking p2p)."""
    schedule = get_schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)
    schedule.validate(comm="buffered")
    return schedule


def first_schedule(layout: Layout, num_stages: int) -> Tuple[int, Schedule]:
    """The first step's micro-batch count (with ``chunks='auto'``, the search's first
    candidate the schedule accepts) and its validated schedule on ``num_stages`` physical
    stages; raises for a schedule that cannot run the layout."""
    def plan(count: int) -> Schedule:
        return validated_schedule(layout.first_schedule, num_stages, count,
                                  layout.virtual_stages)

    chunks = layout.chunks
    if layout.auto_chunks:
        chunks = chunk_count.first_count(num_stages, lambda m: chunk_count.accepted(plan, m))
    return chunks, plan(chunks)
