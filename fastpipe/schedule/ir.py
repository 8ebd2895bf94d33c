"""The schedule intermediate representation: a schedule's data.

A schedule is plain data. A generator produces it once; the same object is then
validated, simulated, drawn and executed, and executors only interpret actions.
:class:`ScheduleData` holds what every analysis reads (the action rows, the placement, the
dependency relation); :class:`fastpipe.schedule.schedule.Schedule`, the class generators
build, adds the analyses themselves as methods.

Terminology:

* *stage* -- a physical pipeline stage (one device / rank), ``0 .. num_stages-1``.
* *chunk* -- one of the ``num_chunks`` model pieces a stage holds.
* *virtual stage* -- the position of a chunk in model order,
  ``0 .. num_stages*num_chunks-1``. ``placement[stage][chunk]`` gives it;
  the default is round-robin (``chunk * num_stages + stage``), as used by
  interleaved 1F1B. A V-shaped placement (stage r holds ``r`` and ``2p-1-r``)
  is just another placement table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING, Iterable, Sequence

from .actions import Action, ActionKind, B, F, W, trusted_action
from .checks import ScheduleError, check_count

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "Action",
    "ActionKind",
    "B",
    "F",
    "Group",
    "Placement",
    "ScheduleData",
    "ScheduleError",
    "W",
    "check_count",
    "round_robin_placement",
]


def round_robin_placement(num_stages: int, num_chunks: int) -> tuple[tuple[int, ...], ...]:
    """Placement where stage ``d`` holds virtual stages ``d, d+p, d+2p, ...``."""
    return tuple(
        tuple(chunk * num_stages + stage for chunk in range(num_chunks))
        for stage in range(num_stages)
    )


Placement = tuple[tuple[int, ...], ...]

Group = tuple[int, ActionKind, int]
"""Actions that differ only in micro-batch: ``(stage, kind, chunk)``."""

_Link = tuple[Group, dict[int, Action]]
"""A group a dependency (or consumer) belongs to, with the schedule's actions in it by
micro-batch."""

_stage_of_action = attrgetter("stage")


def _missing(group: Group, microbatch: int) -> Action:
    """The action of ``microbatch`` in ``group``, for one the schedule lacks."""
    stage, kind, chunk = group
    return trusted_action(stage, kind, microbatch, chunk)


def _plain_row(stage: int, row: tuple[Action, ...]) -> bool:
    """True when ``row`` holds only plain :class:`Action` objects of ``stage`` (checked at C
    speed); otherwise the caller looks action by action."""
    return set(map(type, row)) <= {Action} and set(map(_stage_of_action, row)) <= {stage}


@dataclass(frozen=True)
class ScheduleData:
    """A pipeline schedule's data: for each physical stage, its actions in execution order.

    ``placement[stage][chunk]`` is the virtual stage (model-order index) of that
    chunk; ``None`` means round-robin and is normalised to the explicit table.
    The analyses take this; generators build its subclass
    :class:`~fastpipe.schedule.schedule.Schedule`, which adds them as methods.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1
    placement: Placement | None = field(default=None)

    def __post_init__(self) -> None:
        check_count("num_stages", self.num_stages)
        check_count("num_microbatches", self.num_microbatches)
        check_count("num_chunks", self.num_chunks)
        rows = tuple(tuple(row) for row in self.actions)
        object.__setattr__(self, "actions", rows)
        object.__setattr__(self, "placement", self._normalised_placement())
        self._check_rows()

    def _normalised_placement(self) -> Placement:
        p, v = self.num_stages, self.num_chunks
        if self.placement is None:
            return round_robin_placement(p, v)
        table = tuple(tuple(row) for row in self.placement)
        if len(table) != p or any(len(row) != v for row in table):
            raise ScheduleError(
                f"placement must have {p} rows (one per stage) of {v} entries "
                f"(one per chunk), got {table}"
            )
        if sorted(vs for row in table for vs in row) != list(range(p * v)):
            raise ScheduleError(
                f"placement must use each virtual stage 0..{p * v - 1} exactly once, got {table}"
            )
        return table

    def _check_rows(self) -> None:
        if len(self.actions) != self.num_stages:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.actions)} action rows "
                f"but num_stages={self.num_stages}; give one row per stage"
            )
        for stage, row in enumerate(self.actions):
            if _plain_row(stage, row):
                continue
            for position, action in enumerate(row):
                if not isinstance(action, Action):
                    raise TypeError(
                        f"stage {stage} position {position}: expected an Action, got {action!r}"
                    )
                if action.stage != stage:
                    raise ScheduleError(
                        f"stage {stage} position {position}: action {action} carries "
                        f"stage index {action.stage}; every action in row {stage} "
                        f"must have stage={stage}"
                    )

    # -- placement ---------------------------------------------------------

    @property
    def num_virtual_stages(self) -> int:
        """Number of model chunks in model order (``num_stages * num_chunks``)."""
        return self.num_stages * self.num_chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """Model-order index of ``chunk`` held by physical ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} is out of range 0..{self.num_stages - 1}")
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk={chunk} is out of range 0..{self.num_chunks - 1}")
        return self.placement[stage][chunk]

    def stage_of(self, virtual_stage: int) -> tuple[int, int]:
        """The ``(stage, chunk)`` holding ``virtual_stage``."""
        try:
            return self._where[virtual_stage]
        except KeyError:
            raise ValueError(
                f"virtual_stage={virtual_stage} is out of range 0..{self.num_virtual_stages - 1}"
            ) from None

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {
            vs: (stage, chunk)
            for stage, row in enumerate(self.placement)
            for chunk, vs in enumerate(row)
        }

    def virtual_stage_of(self, action: Action) -> int:
        """Model-order index of the chunk ``action`` runs on."""
        return self.virtual_stage(action.stage, action.chunk)

    @cached_property
    def split_backwards(self) -> frozenset[tuple[int, int]]:
        """The (virtual stage, micro-batch) pairs whose backward is split into B and W."""
        return frozenset((self.virtual_stage_of(a), a.microbatch)
                         for row in self.actions for a in row if a.kind is ActionKind.WEIGHT)

    @cached_property
    def forward_actions(self) -> tuple[tuple[Action, ...], ...]:
        """Each stage's forward actions in order: the schedule of a forward-only pass."""
        return tuple(tuple(a for a in row if a.kind is ActionKind.FORWARD)
                     for row in self.actions)

    def action_at(self, kind: ActionKind, virtual_stage: int, microbatch: int) -> Action:
        """The action of ``kind`` for ``microbatch`` on ``virtual_stage``, wherever it is
        placed."""
        stage, chunk = self.stage_of(virtual_stage)
        return Action(stage, kind, microbatch, chunk)

    # -- dependencies --------------------------------------------------------

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """Actions whose results ``action`` consumes, on the same or other stages.

        ``F`` needs ``F`` of the same micro-batch on the previous virtual stage;
        ``B`` needs its own ``F`` and ``B`` on the next virtual stage; ``W`` needs
        its own ``B``. Lowering, validation and simulation share this single definition,
        asking for many actions at once through :meth:`dependency_groups`.
        """
        links = self._dependency_links.get((action.stage, action.kind, action.chunk))
        if links is None:
            links = self._dependency_links_of((action.stage, action.kind, action.chunk))
        mb = action.microbatch
        deps = []
        for group, actions in links:
            deps.append(actions.get(mb) or _missing(group, mb))
        return tuple(deps)

    def consumers(self, action: Action) -> tuple[Action, ...]:
        """Actions listing ``action`` among their :meth:`dependencies` (the inverse relation)."""
        links = self._consumer_links.get((action.stage, action.kind, action.chunk))
        if links is None:
            links = self._consumer_links_of((action.stage, action.kind, action.chunk))
        mb = action.microbatch
        users = []
        for group, actions in links:
            user = actions.get(mb)
            if user is not None:
                users.append(user)
            elif group[1] is not ActionKind.WEIGHT:  # a B feeds a W only when there is one
                users.append(_missing(group, mb))
        return tuple(users)

    def dependency_groups(
        self, stage: int, kind: ActionKind, chunk: int
    ) -> tuple[Group, ...] | None:
        """The ``(stage, kind, chunk)`` groups whose action of micro-batch ``k`` is a dependency
        of this group's action of micro-batch ``k``, for every ``k``: :meth:`dependencies` in
        bulk. ``None`` when a subclass redefines :meth:`dependencies`: ask action by action."""
        if type(self).dependencies is not ScheduleData.dependencies:
            return None
        return tuple(group for group, _ in self._dependency_links_of((stage, kind, chunk)))

    def consumer_groups(
        self, stage: int, kind: ActionKind, chunk: int
    ) -> tuple[Group, ...] | None:
        """Like :meth:`dependency_groups` for :meth:`consumers`, except that a ``B``'s ``W``
        group (on the same stage) counts only for the micro-batches that have a ``W``."""
        if type(self).consumers is not ScheduleData.consumers:
            return None
        return tuple(group for group, _ in self._consumer_links_of((stage, kind, chunk)))

    def _dependency_links_of(self, key: Group) -> tuple[_Link, ...]:
        links = self._dependency_links.get(key)
        if links is None:
            links = self._dependency_links[key] = self._links(self._dependency_rule(key))
        return links

    def _consumer_links_of(self, key: Group) -> tuple[_Link, ...]:
        links = self._consumer_links.get(key)
        if links is None:
            links = self._consumer_links[key] = self._links(self._consumer_rule(key))
        return links

    def _dependency_rule(self, group: Group) -> tuple[Group, ...]:
        """The rule of :meth:`dependencies`, for all micro-batches of a group at once."""
        stage, kind, chunk = group
        vs = self.virtual_stage(stage, chunk)
        if kind is ActionKind.FORWARD:
            return (self._group(F, vs - 1),) if vs > 0 else ()
        if kind is ActionKind.WEIGHT:
            return ((stage, B, chunk),)
        deps = [(stage, F, chunk)]
        if vs < self.num_virtual_stages - 1:
            deps.append(self._group(B, vs + 1))
        return tuple(deps)

    def _consumer_rule(self, group: Group) -> tuple[Group, ...]:
        """The inverse of :meth:`_dependency_rule`; a ``B``'s ``W`` group is listed, though it
        holds a consumer only for the micro-batches that have a ``W``."""
        stage, kind, chunk = group
        vs = self.virtual_stage(stage, chunk)
        if kind is ActionKind.FORWARD:
            out = [(stage, B, chunk)]
            if vs < self.num_virtual_stages - 1:
                out.append(self._group(F, vs + 1))
            return tuple(out)
        if kind is ActionKind.WEIGHT:
            return ()
        return ((self._group(B, vs - 1),) if vs > 0 else ()) + ((stage, W, chunk),)

    def _group(self, kind: ActionKind, virtual_stage: int) -> Group:
        stage, chunk = self.stage_of(virtual_stage)
        return (stage, kind, chunk)

    def _links(self, groups: tuple[Group, ...]) -> tuple[_Link, ...]:
        return tuple((group, self.actions_by_group.get(group, {})) for group in groups)

    @cached_property
    def actions_by_group(self) -> dict[Group, dict[int, Action]]:
        """The schedule's actions by group, then micro-batch (the last one where one repeats):
        the table the analyses look actions up in. Shared: read it, never change it."""
        return self._tables[0]

    @cached_property
    def positions_by_group(self) -> dict[Group, dict[int, int]]:
        """Like :attr:`actions_by_group`, but each action's position in its stage's row."""
        return self._tables[1]

    @cached_property
    def _tables(self) -> tuple[dict[Group, dict[int, Action]], dict[Group, dict[int, int]]]:
        """:attr:`actions_by_group` and :attr:`positions_by_group`, built in one pass over the
        rows."""
        index: dict[Group, dict[int, Action]] = {}
        positions: dict[Group, dict[int, int]] = {}
        for row in self.actions:
            for position, action in enumerate(row):
                key = (action.stage, action.kind, action.chunk)
                if key not in index:
                    index[key], positions[key] = {}, {}
                index[key][action.microbatch] = action
                positions[key][action.microbatch] = position
        return index, positions

    @cached_property
    def _dependency_links(self) -> dict[Group, tuple[_Link, ...]]:
        """Per group, its dependency groups with their actions, filled as groups are asked."""
        return {}

    @cached_property
    def _consumer_links(self) -> dict[Group, tuple[_Link, ...]]:
        """Per group, its consumer groups with their actions, filled as groups are asked."""
        return {}

    # -- text forms --------------------------------------------------------

    def to_strings(self) -> list[list[str]]:
        """The action table as compact strings, one list per stage."""
        return [[str(a) for a in row] for row in self.actions]

    @classmethod
    def from_strings(
        cls,
        name: str,
        table: Sequence[str | Sequence[str]],
        num_microbatches: int | None = None,
        num_chunks: int = 1,
        placement: Placement | None = None,
    ) -> Self:
        """Build a schedule from one row per stage: a list of action strings or one
        space-separated string. ``num_microbatches`` defaults to the largest one used + 1."""
        rows = tuple(tuple(Action.parse(s) for s in _split_row(row)) for row in table)
        if num_microbatches is None:
            used = [a.microbatch for row in rows for a in row]
            if not used:
                raise ValueError("cannot infer num_microbatches from an empty table; pass it")
            num_microbatches = max(used) + 1
        return cls(name, len(rows), num_microbatches, rows, num_chunks, placement)

    def format_table(self) -> str:
        """A readable table: a header line, then one row of actions per stage."""
        cells = self.to_strings()
        width = max((len(c) for row in cells for c in row), default=0)
        label = len(f"stage {self.num_stages - 1}")
        chunks = f", {self.num_chunks} chunks" if self.num_chunks > 1 else ""
        lines = [
            f"{self.name}: {self.num_stages} stages, "
            f"{self.num_microbatches} micro-batches{chunks}"
        ]
        for stage, row in enumerate(cells):
            body = " ".join(c.ljust(width) for c in row).rstrip()
            lines.append(f"{f'stage {stage}':<{label}} | {body}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def _split_row(row: str | Iterable[str]) -> list[str]:
    return row.split() if isinstance(row, str) else list(row)
