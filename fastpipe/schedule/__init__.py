"""Pipeline schedules as data: the IR, generators, lowering, validation and the timed simulator.

Generators are looked up by name in :data:`SCHEDULES`; new ones register with
:func:`register_schedule`.
"""

from __future__ import annotations

from typing import Any, Callable

from .actions import Action, ActionKind
from .checks import ScheduleError, check_count
from .dualpipev import dualpipev
from .gpipe import gpipe
from .interleaved import interleaved
from .interchange import InterchangeError, from_actions, to_actions
from .interchange_csv import read_csv, write_csv
from .lockstep import run_lockstep
from .looped_bfs import looped_bfs
from .lower import Comm, CommGroup, CommKind, Op, Payload, SkipLink, format_program, lower
from .nccl import lower_nccl
from .one_f_one_b import one_f_one_b
from .pipedream import pipedream
from .recommend import Recommendation, recommend
from .registry import ASYNCHRONOUS, SCHEDULES, ScheduleFn, get_schedule, register_schedule
from .schedule import Schedule
from .simulator import Costs, SimulationResult, simulate
from .timeline import Event, Timeline
from .validate import ValidationReport, peak_inflight, validate
from .zbv import zbv
from .zero_bubble import zb_h1

__all__ = [
    "Action",
    "ActionKind",
    "Comm",
    "Costs",
    "Event",
    "InterchangeError",
    "CommGroup",
    "CommKind",
    "Op",
    "Payload",
    "Recommendation",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleFn",
    "SimulationResult",
    "SkipLink",
    "Timeline",
    "ValidationReport",
    "dualpipev",
    "format_program",
    "from_actions",
    "get_schedule",
    "gpipe",
    "interleaved",
    "looped_bfs",
    "lower",
    "lower_nccl",
    "one_f_one_b",
    "peak_inflight",
    "pipedream",
    "read_csv",
    "recommend",
    "register_schedule",
    "run_lockstep",
    "simulate",
    "to_actions",
    "validate",
    "write_csv",
    "zb_h1",
    "zbv",
]

