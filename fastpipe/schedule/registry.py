"""The schedules by name: ``get_schedule('1f1b', stages, micro_batches)``, ``register_schedule``."""
from __future__ import annotations

from typing import Any, Callable

from .dualpipev import dualpipev
from .gpipe import gpipe
from .interleaved import interleaved
from .checks import check_count
from .schedule import Schedule
from .looped_bfs import looped_bfs
from .one_f_one_b import one_f_one_b
from .pipedream import pipedream
from .zbv import zbv
from .zero_bubble import zb_h1

ScheduleFn = Callable[..., Schedule]
"""A generator: ``fn(num_stages, num_microbatches, **options) -> Schedule``."""

SCHEDULES: dict[str, ScheduleFn] = {}
"""Registered schedule generators by (lower-case) name."""


def register_schedule(name: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Decorator registering a generator under ``name`` so :func:`get_schedule` finds it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"schedule name must be a non-empty string, got {name!r}")
    key = name.lower()

    def decorate(fn: ScheduleFn) -> ScheduleFn:
        if SCHEDULES.get(key, fn) is not fn:
            raise ValueError(f"schedule name {key!r} is already registered to {SCHEDULES[key]!r}")
        SCHEDULES[key] = fn
        return fn

    return decorate


def get_schedule(name: str, num_stages: int, num_microbatches: int, **kw: Any) -> Schedule:
    """Generate the schedule registered as ``name`` (case-insensitive) for the given sizes."""
    fn = SCHEDULES.get(name.lower()) if isinstance(name, str) else None
    if fn is None:
        valid = ", ".join(repr(n) for n in sorted(SCHEDULES))
        raise ValueError(f"schedule={name!r} is not a known schedule; valid names: {valid}")
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    return fn(num_stages, num_microbatches, **kw)


register_schedule("gpipe")(gpipe)
register_schedule("1f1b")(one_f_one_b)
register_schedule("interleaved")(interleaved)
register_schedule("looped-bfs")(looped_bfs)
register_schedule("zb-h1")(zb_h1)
register_schedule("zbv")(zbv)
register_schedule("dualpipev")(dualpipev)
register_schedule("pipedream")(pipedream)

ASYNCHRONOUS = frozenset({"pipedream"})
"""Schedules that update weights inside a step (not flushes): never picked automatically."""
