"""Reading pipelining's action lists into a checked :class:`Schedule` (see
:mod:`fastpipe.schedule.interchange` for the rules): the placement inferred from which row runs
which stage, every action in range and present once, each rank's order, the transfers given
against fastpipe's lowering, and deadlock freedom under the NCCL model; each error placed by a
:class:`~fastpipe.schedule.interchange_cells.Locator`."""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from .actions import Action, ActionKind
from .checks import ScheduleError, check_count
from .interchange_cells import COMMS, COMPUTE, Cell, InterchangeError, Locator, parse_cell
from .interchange_export import action_text, comm_text
from .ir import Placement
from .lower import lower
from .schedule import Schedule

__all__ = ["Rows", "build_schedule"]

Rows = Sequence[Sequence[Optional[str]]]
"""Per rank, its action strings in order (``None`` or ``""``: an idle step)."""

_GROUP = {"F": "F", "B": "B", "I": "B", "W": "W"}  # pipelining's type -> fastpipe's kind


def build_schedule(rows: Rows, locator: Locator, name: str,
                   num_microbatches: Optional[int] = None) -> Schedule:
    """:func:`from_actions` with errors placed by ``locator`` (rows, or a file's lines)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if num_microbatches is not None:
        check_count("num_microbatches", num_microbatches)
    reader = _Reader(_parse_rows(rows, locator), locator, num_microbatches)
    schedule = reader.schedule(name)
    reader.check_order(schedule)
    reader.check_comms(schedule)
    _check_deadlock(schedule, reader)
    return schedule


def _parse_rows(rows: Rows, locator: Locator) -> list[list[tuple[int, Cell]]]:
    """Each row's cells, parsed, with their index (idle cells dropped)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a list of rows (one list of action strings per rank), "
                        f"got {type(rows).__name__}")
    out = []
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"{locator.row(r)}: expected a list of action strings, got "
                            f"{type(row).__name__} {row!r}")
        cells = []
        for i, text in enumerate(row):
            try:
                cells.extend((i, cell) for cell in parse_cell(text))
            except ValueError as exc:
                raise locator.error(str(exc), r, i, text) from None
        out.append(cells)
    if not out:
        raise InterchangeError("rows is empty: give one list of action strings per rank")
    return out


class _Reader:
    """The checked facts of parsed rows: each stage's rank and chunk, the micro-batch count,
    and where each compute action is."""

    def __init__(self, cells: list[list[tuple[int, Cell]]], locator: Locator,
                 num_microbatches: Optional[int]) -> None:
        self.cells, self.locator = cells, locator
        compute = [(r, i, c) for r, row in enumerate(cells) for i, c in row if c.kind in COMPUTE]
        self.rank_of = _stage_ranks(compute, locator)
        self.placement = _placement(self.rank_of, len(cells), locator)
        self.chunk_of = {s: row.index(s) for row in self.placement for s in row}
        self.num_microbatches = _microbatches(compute, num_microbatches, locator)
        self.found = _found(compute, locator)

    def schedule(self, name: str) -> Schedule:
        """The schedule, once every compute action is present once."""
        for stage in range(len(self.rank_of)):
            for mb in range(self.num_microbatches):
                self._check_present(stage, mb)
        rows = [[self._action(r, c) for _, c in row if c.kind in COMPUTE]
                for r, row in enumerate(self.cells)]
        return Schedule(name, len(self.cells), self.num_microbatches, rows,
                        len(self.placement[0]), self.placement)

    def _action(self, rank: int, cell: Cell) -> Action:
        kind = ActionKind(_GROUP[cell.kind])
        return Action(rank, kind, cell.microbatch, self.chunk_of[cell.stage])

    def _check_present(self, stage: int, mb: int) -> None:
        rank, found = self.rank_of[stage], self.found
        if ("F", stage, mb) not in found:
            raise self.locator.error(f"stage {stage} has no forward of micro-batch {mb} "
                                     f"('{stage}F{mb}' is missing)", rank)
        backward = found.get(("B", stage, mb))
        if backward is None:
            raise self.locator.error(
                f"stage {stage} has no backward of micro-batch {mb} ('{stage}B{mb}', or "
                f"'{stage}I{mb}' with '{stage}W{mb}', is missing)", rank)
        weight = found.get(("W", stage, mb))
        if backward[2] == "I" and weight is None:
            raise self.locator.error(
                f"backward input needs its backward weight '{stage}W{mb}' in the same row; "
                f"write '{stage}B{mb}' for a full backward", rank, backward[1], f"{stage}I{mb}")
        if backward[2] == "B" and weight is not None:
            raise self.locator.error(
                f"'{stage}B{mb}' is a full backward, so there is no weight gradient left for "
                f"this W; write '{stage}I{mb}' (backward input) instead", rank, weight[1],
                f"{stage}W{mb}")

    def check_order(self, schedule: Schedule) -> None:
        """Each rank runs an action after its inputs computed on the same rank."""
        for r, row in enumerate(schedule.actions):
            done: set[Action] = set()
            for action in row:
                for dep in schedule.dependencies(action):
                    if dep.stage == r and dep not in done:
                        self._before(schedule, action, dep)
                done.add(action)

    def _before(self, schedule: Schedule, action: Action, dep: Action) -> None:
        text, needed = action_text(schedule, action), action_text(schedule, dep)
        r, i, _ = self.found[_key(text)]
        raise self.locator.error(f"runs before '{needed}' (index {self.found[_key(needed)][1]})"
                                 f", whose result it takes on the same rank", r, i, text)

    def check_comms(self, schedule: Schedule) -> None:
        """Given communication actions must be the transfers of fastpipe's lowering, each a
        receive before the action that takes it, a send after the one that makes it."""
        given = [[(i, c) for i, c in row if c.kind in COMMS] for row in self.cells]
        if not any(given):
            return
        lowered = [Counter(comm_text(comm) for op in program if not isinstance(op, Action)
                           for comm in op.ops) for program in lower(schedule)]
        for r, row in enumerate(given):
            for i, cell in row:
                self._check_comm(r, i, cell, lowered[r])
            for text, count in lowered[r].items():
                if count:
                    raise self.locator.error(
                        f"the transfer '{text}' of fastpipe's lowering is missing (a list with "
                        f"communication actions must give every one)", r)

    def _check_comm(self, r: int, i: int, cell: Cell, expected: Counter) -> None:
        text = str(cell)
        if cell.microbatch is None or not expected[text]:
            raise self.locator.error(
                f"fastpipe's lowering of the compute actions has no (further) transfer "
                f"'{text}' on this rank (stages {self._stages_of(r)} run here)", r, i, text)
        expected[text] -= 1
        produced = cell.kind.startswith("SEND")
        kind = "F" if cell.kind.endswith("F") else "B"
        _, at, _ = self.found[(kind, cell.stage, cell.microbatch)]
        if (at > i) if produced else (at < i):
            order = "before the action that makes" if produced else "after the action that takes"
            raise self.locator.error(f"comes {order} it (index {at})", r, i, text)

    def _stages_of(self, rank: int) -> list[int]:
        return list(self.placement[rank])

    def first_blocked(self, schedule: Schedule) -> list[tuple[int, int, str]]:
        """Each rank's first action that can never run (its input waits behind another's):
        (row, index, action string), what a deadlock blocks."""
        done: set[Action] = set()
        position = [0] * schedule.num_stages
        moved = True
        while moved:
            moved = False
            for r, row in enumerate(schedule.actions):
                while position[r] < len(row) and all(
                        d in done for d in schedule.dependencies(row[position[r]])):
                    done.add(row[position[r]])
                    position[r], moved = position[r] + 1, True
        out = []
        for r, row in enumerate(schedule.actions):
            if position[r] < len(row):
                text = action_text(schedule, row[position[r]])
                out.append((r, self.found[_key(text)][1], text))
        return out


def _key(text: str) -> tuple[str, int, int]:
    cell = parse_cell(text)[0]
    return _GROUP[cell.kind], cell.stage, cell.microbatch


def _stage_ranks(compute: list[tuple[int, int, Cell]], locator: Locator) -> list[int]:
    """Each stage's rank (the row that runs it), one rank per stage, stages 0..S-1."""
    seen = {c.stage for _, _, c in compute}
    ranks: dict[int, tuple[int, int]] = {}
    for r, i, cell in compute:
        if cell.stage >= len(seen):
            missing = sorted(set(range(cell.stage)) - seen)
            raise locator.error(f"stage {cell.stage} is out of range: the actions run "
                                f"{len(seen)} stages, so stage indices are 0..{len(seen) - 1} "
                                f"(stages {missing} run nothing)", r, i, cell)
        first = ranks.setdefault(cell.stage, (r, i))
        if first[0] != r:
            raise locator.error(f"stage {cell.stage} runs on {locator.cell(*first)} too: a "
                                f"stage belongs to one rank", r, i, cell)
        if cell.microbatch is None:
            raise locator.error("a compute action needs its micro-batch index, e.g. "
                                f"'{cell}0'", r, i, cell)
    return [ranks[s][0] for s in range(len(seen))]


def _placement(rank_of: list[int], num_ranks: int, locator: Locator) -> Placement:
    """Rank ``r``'s stages in model order (its chunks); the same count on every rank."""
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for stage, rank in enumerate(rank_of):
        held[rank].append(stage)
    for r, stages in enumerate(held):
        if not stages:
            raise locator.error("this rank runs no compute action (F, I, B or W): every rank "
                                "holds at least one stage", r)
        if len(stages) != len(held[0]):
            raise locator.error(
                f"this rank runs stages {stages} but {locator.row(0)} runs {held[0]}: fastpipe "
                f"places the same number of stages on every rank", r)
    return tuple(tuple(stages) for stages in held)


def _microbatches(compute: list[tuple[int, int, Cell]], given: Optional[int],
                  locator: Locator) -> int:
    """The micro-batch count: ``given``, or the number of distinct ones the actions name."""
    count = given if given is not None else len({c.microbatch for _, _, c in compute})
    for r, i, cell in compute:
        if cell.microbatch >= count:
            how = "num_microbatches=" if given is not None else "the actions name "
            raise locator.error(f"micro-batch {cell.microbatch} is out of range: {how}{count}, "
                                f"so micro-batch indices are 0..{count - 1}", r, i, cell)
    return count


def _found(compute: list[tuple[int, int, Cell]],
           locator: Locator) -> dict[tuple[str, int, int], tuple[int, int, str]]:
    """Where each compute action is: (fastpipe kind, stage, micro-batch) -> (row, index, type);
    an action given twice (``I`` and ``B`` of one micro-batch included) raises."""
    found: dict[tuple[str, int, int], tuple[int, int, str]] = {}
    for r, i, cell in compute:
        key = (_GROUP[cell.kind], cell.stage, cell.microbatch)
        if key in found:
            first = found[key]
            raise locator.error(f"repeats {locator.cell(first[0], first[1])}: each action "
                                f"runs once", r, i, cell)
        found[key] = (r, i, cell.kind)
    return found


def _check_deadlock(schedule: Schedule, reader: _Reader) -> None:
    """``validate(comm="nccl")``; a deadlock names the blocked cells, then the rounds."""
    try:
        schedule.validate(comm="nccl")
    except ScheduleError as exc:
        blocked = reader.first_blocked(schedule)
        where = " and ".join(reader.locator.cell(*cell) for cell in blocked)
        first = blocked[0][:2] if blocked else (None, None)
        raise InterchangeError(
            f"{where + ': ' if where else ''}the action lists deadlock under the NCCL model, "
            f"each of these waiting for another's input (in fastpipe's terms, where a stage is a "
            f"rank: {exc})", *first) from None
