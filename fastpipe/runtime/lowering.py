"""The programs a step runs: :func:`fastpipe.schedule.lower`'s, with each action's messages.

The executors run the stage programs that ``lower(schedule, local=True, skips=...)`` gives:
every tensor a step hands from one virtual stage to another (activations, gradients, skip
connections, between stages or between chunks of one stage) is a send op after the action that
produces it and a receive op before the action that consumes it. The receive op is the
message's key in the receiving stage's mailbox, on both ends and on every transport; an action is
ready when the receive ops before it have arrived. These very programs are proven free of
deadlock under buffered sends (the executors' semantics) once, when first lowered.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..schedule import (Action, ActionKind, Comm, CommGroup, CommKind, Op, Payload, Schedule,
                        SkipLink, lower, lower_nccl, run_lockstep)


Place = Tuple[int, ActionKind, int]  # an action's (virtual stage, kind, micro-batch)


class Route(NamedTuple):
    """The messages of one action: what it waits for and takes, and where its results go."""

    virtual_stage: int
    waits: Tuple[Comm, ...]  # the keys of every message it takes, in program order
    sources: Tuple[int, ...]  # the virtual stage that sends each of ``waits``
    input: Optional[Comm]  # the key of its neighbour's activation (F) or gradient (B)
    skip_inputs: Dict[str, Comm]  # skip connection name -> key of its tensor or gradient
    output: Optional[Tuple[int, Comm]]  # (receiving virtual stage, key) of its result
    skip_outputs: Dict[str, Tuple[int, Comm]]  # the same for each skip connection


@dataclass(frozen=True)
class Lowering:
    """One step's lowered programs (one per physical stage) and every action's :class:`Route`."""

    schedule: Schedule
    programs: Tuple[Tuple[Op, ...], ...]
    routes: Dict[Place, Route]  # by (virtual stage, kind, micro-batch)
    rows: Tuple[Tuple[Tuple[Action, Route], ...], ...]  # each stage's actions, with routes
    skips: Tuple[SkipLink, ...] = ()
    nccl: Dict[str, Any] = field(default_factory=dict, compare=False)  # built on first use

    def sources(self, stage: int) -> List[int]:
        """The sending virtual stage of every message ``stage``'s program takes, in order."""
        return [v for _, route in self.rows[stage] for v in route.sources]


def skip_links(plans: Iterable[Any]) -> Tuple[SkipLink, ...]:
    """The skip connections of the stages' skip plans (``fastpipe.skip.layout.StageSkips``:
    ``index``, ``sends`` as (name, consumer) and ``receives`` as (name, producer)), by name."""
    found = set()
    for plan in plans:
        found.update(SkipLink(name, plan.index, dst) for name, dst in plan.sends)
        found.update(SkipLink(name, src, plan.index) for name, src in plan.receives)
    return tuple(sorted(found))


def lowering(schedule: Schedule, rows: Sequence[Sequence[Action]],
             skips: Tuple[SkipLink, ...]) -> Lowering:
    """The lowering of ``rows`` (``schedule.actions`` or a subset, e.g. its forward actions)
    with ``skips``; built, validated and cached on first use."""
    key = (id(schedule), id(rows), skips)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is schedule and hit[1] is rows:
            _cache.move_to_end(key)
            return hit[2]
    found = _build(schedule, rows, skips)
    with _lock:
        _cache[key] = (schedule, rows, found)  # holding them keeps their ids unique
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return found


_CACHE_SIZE = 64
_cache: "OrderedDict[tuple, Tuple[Schedule, Any, Lowering]]" = OrderedDict()
_lock = threading.Lock()


def _build(schedule: Schedule, rows: Sequence[Sequence[Action]],
           skips: Tuple[SkipLink, ...]) -> Lowering:
    if rows is not schedule.actions:
        schedule = Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches,
                            tuple(tuple(row) for row in rows), schedule.num_chunks,
                            schedule.placement)
    programs = lower(schedule, local=True, skips=skips)
    run_lockstep(schedule, programs, comm="buffered")  # raises ScheduleError on a deadlock
    split = [_split(program) for program in programs]
    # a sender keys its message with the very receive op the receiver waits for (found by
    # identity in the mailbox, without comparing fields)
    receive_ops = {comm: comm for entries in split for _, receives, _ in entries
                   for comm in receives}
    rows = tuple(tuple((action, _route(schedule, stage, action, receives, sends, receive_ops))
                       for action, receives, sends in entries)
                 for stage, entries in enumerate(split))
    routes = {(r.virtual_stage, a.kind, a.microbatch): r for row in rows for a, r in row}
    return Lowering(schedule, programs, routes, rows, skips)


def _split(program: Sequence[Any]) -> List[Tuple[Action, List[Comm], List[Comm]]]:
    """Each action of a program with the receives before it and the sends after it."""
    entries: List[Tuple[Action, List[Comm], List[Comm]]] = []
    receives: List[Comm] = []
    for op in program:
        if isinstance(op, CommGroup):
            for comm in op.ops:
                if comm.kind is CommKind.SEND:
                    entries[-1][2].append(comm)
                else:
                    receives.append(comm)
        else:
            entries.append((op, receives, []))
            receives = []
    return entries


def _route(schedule: Schedule, stage: int, action: Action, receives: List[Comm],
           sends: List[Comm], receive_ops: Dict[Comm, Comm]) -> Route:
    v = schedule.virtual_stage_of(action)
    keys = [comm.counterpart(stage) for comm in sends]  # the receive ops they match
    keys = [receive_ops.get(key, key) for key in keys]
    targets = [(key.virtual_stage, key) for key in keys]
    main_in = [c for c in receives if c.skip is None]
    main_out = [t for t in targets if t[1].skip is None]
    return Route(v, tuple(receives),
                 tuple(c.counterpart(stage).virtual_stage for c in receives),
                 main_in[0] if main_in else None,
                 {c.skip.name: c for c in receives if c.skip is not None},
                 main_out[0] if main_out else None,
                 {t[1].skip.name: t for t in targets if t[1].skip is not None})


def nccl_programs(lowered: Lowering) -> Tuple[Tuple[Op, ...], ...]:
    """The step's NCCL programs (:func:`fastpipe.schedule.lower_nccl` with ``prefetch``: a
    group of receives only is posted before the action ahead of it),
    for ``DistributedPipe(p2p="grouped")``, proven free of deadlock under the NCCL model when
    first built."""
    with _lock:
        found = lowered.nccl.get("programs")
    if found is None:
        found = lower_nccl(lowered.schedule, skips=lowered.skips, prefetch=True)
        run_lockstep(lowered.schedule, found, comm="nccl")  # raises ScheduleError on a deadlock
        with _lock:
            lowered.nccl["programs"] = found
    return found


def is_ready(step: Any, route: Route) -> bool:
    """Whether every message an action takes has arrived in its stage's mailbox."""
    box = step.mailboxes[route.virtual_stage]
    for key in route.waits:
        if not box.has(key):
            return False
    return True


def carries_loss(key: Comm) -> bool:
    """Whether a message is a stage's input gradient (its header carries the loss)."""
    return key.what is Payload.GRAD and key.skip is None
