"""Schedules as CSV files, in the layout of torchtitan's ``pipeline_parallel_schedule_csv`` and
pipelining's ``_load_csv`` / ``_dump_csv``: one line per rank, one cell per action string
(:mod:`fastpipe.schedule.interchange`), an empty cell for an idle step.

``write_csv(pipe.plan(), "schedule.csv")`` hands a fastpipe schedule to torchtitan;
``fastpipe.Pipe(model, schedule=read_csv("schedule.csv"))`` runs one of theirs. Errors name the
file's line and column.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Optional, Union

from .interchange_export import to_actions
from .interchange_read import build_schedule
from .interchange_cells import CsvLocator
from .ir import ScheduleData
from .schedule import Schedule

__all__ = ["read_csv", "write_csv"]

PathLike = Union[str, "os.PathLike[str]"]


def read_csv(path: PathLike, *, name: Optional[str] = None,
             num_microbatches: Optional[int] = None) -> Schedule:
    """The schedule in the CSV file at ``path``, checked (see
    :func:`~fastpipe.schedule.interchange.from_actions`); named ``name`` (default: the file's
    name without its extension). Trailing empty lines are ignored."""
    path = _checked_path(path)
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    return build_schedule(rows, CsvLocator(path), name or Path(path).stem, num_microbatches)


def write_csv(schedule: ScheduleData, path: PathLike, *, comms: Optional[str] = None) -> None:
    """Write ``schedule`` to ``path`` as CSV, one line per rank; ``comms`` (``"lower"`` or
    ``"nccl"``) adds the sends and receives of that lowering (see
    :func:`~fastpipe.schedule.interchange.to_actions`)."""
    if not isinstance(schedule, ScheduleData):
        raise TypeError(f"schedule must be a fastpipe Schedule, got {type(schedule).__name__}")
    rows = to_actions(schedule, comms=comms)
    path = _checked_path(path)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)


def _checked_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    return os.fspath(path)
