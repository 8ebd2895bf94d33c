"""PyTorch pipelining's action strings, one cell at a time, and where a bad one is.

``torch.distributed.pipelining`` and torchtitan write a schedule as one list of action strings per
rank (``_Action``'s text form): ``<stage><type>[<micro-batch>]`` with the stage a *virtual*
stage (model order), e.g. ``2F0`` (forward), ``2B0`` (full backward), ``2I0`` / ``2W0``
(backward input / backward weight, a split backward), ``2SEND_F0`` / ``3RECV_F0`` /
``3SEND_B0`` / ``2RECV_B0`` (communication), ``2UNSHARD`` / ``2RESHARD`` / ``2REDUCE_GRAD``
(FSDP), ``(0F1;3B0)OVERLAP_F_B`` (a forward and a backward run overlapped), and an empty cell
for an idle step. This module reads one cell (:func:`parse_cell`) and says where a cell is, in
a list of rows or in a CSV file (:class:`Locator`), for :class:`InterchangeError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

from .checks import ScheduleError

__all__ = ["COMMS", "COMPUTE", "Cell", "CsvLocator", "IGNORED", "InterchangeError", "Locator",
           "parse_cell"]

COMPUTE = ("F", "I", "B", "W")
"""Compute types: forward, backward input, full backward, backward weight."""

COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Communication types: an activation sent / received, a gradient sent / received."""

IGNORED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
"""FSDP's gather and release of a stage's parameters and its gradient reduction: fastpipe's
FSDP keeps a stage's parameters gathered from its first forward to its last backward of the
step and reduces its gradients with that last backward (``fastpipe.parallel.fsdp``), so these
have no place in its IR and are skipped on import."""

_ACTION = re.compile(r"(\d+)(" + "|".join(sorted(COMPUTE + COMMS + IGNORED, key=len,
                                                 reverse=True)) + r")(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_FORM = ("'<stage><F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD>"
         "[<micro-batch>]', e.g. '2F0' or '3SEND_B1', '(<action>;<action>)OVERLAP_F_B', "
         "or an empty cell")


class InterchangeError(ScheduleError):
    """An action list or CSV file that fastpipe cannot take: an unknown action string, a stage
    or micro-batch out of range, a missing or repeated action, an order that runs an action
    before its input or deadlocks, or communication that disagrees with fastpipe's lowering.
    ``row`` and ``index`` (0-based, ``None`` where unknown) say where; the message says it in
    the input's own terms (``row 1, index 4`` or ``file.csv, line 2, column 5``)."""

    def __init__(self, message: str, row: Optional[int] = None,
                 index: Optional[int] = None) -> None:
        super().__init__(message)
        self.row, self.index = row, index


class Cell(NamedTuple):
    """One action of a cell: its type, virtual stage and micro-batch (``None``: not given)."""

    kind: str
    stage: int
    microbatch: Optional[int]

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"


def parse_cell(text: object) -> tuple[Cell, ...]:
    """The actions of one cell: none for an idle step (``None`` or an empty string), one for an
    action string, the sub-actions in order for ``OVERLAP_F_B`` (fastpipe runs them one after
    the other: the result is the same). ``ValueError`` says what is wrong."""
    if text is None:
        return ()
    if not isinstance(text, str):
        raise ValueError(f"expected an action string or None, got {type(text).__name__} "
                         f"{text!r}")
    text = text.strip()
    if not text:
        return ()
    overlap = _OVERLAP.fullmatch(text)
    if overlap is not None:
        cells = tuple(_one(part.strip()) for part in overlap.group(1).split(";") if part.strip())
        if not all(cell.kind in COMPUTE for cell in cells):
            raise ValueError(f"OVERLAP_F_B holds compute actions only, got {text!r}")
        return cells
    return (_one(text),)


def _one(text: str) -> Cell:
    match = _ACTION.fullmatch(text)
    if match is None:
        raise ValueError(f"unknown action {text!r}: expected {_FORM}")
    stage, kind, microbatch = match.groups()
    return Cell(kind, int(stage), int(microbatch) if microbatch else None)


class Locator:
    """Where a cell is in a list of rows (one per rank): ``row r, index i``, 0-based."""

    def cell(self, row: int, index: int, text: object = None) -> str:
        """The place of one cell, with its text when given."""
        shown = "" if text is None else f" ({str(text).strip()!r})"
        return f"{self.row(row)}, {self._index(index)}{shown}"

    def row(self, row: int) -> str:
        """The place of one row (one rank)."""
        return f"row {row}"

    def _index(self, index: int) -> str:
        return f"index {index}"

    def error(self, message: str, row: int, index: Optional[int] = None,
              text: object = None) -> InterchangeError:
        """An :class:`InterchangeError` at a cell (or a whole row when ``index`` is ``None``)."""
        where = self.row(row) if index is None else self.cell(row, index, text)
        return InterchangeError(f"{where}: {message}", row, index)


class CsvLocator(Locator):
    """Where a cell is in a CSV file, one line per rank: ``FILE, line L, column C``, 1-based."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def row(self, row: int) -> str:
        return f"{self.path}, line {row + 1}"

    def _index(self, index: int) -> str:
        return f"column {index + 1}"
