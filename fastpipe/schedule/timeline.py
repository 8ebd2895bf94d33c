"""Timelines: when each action ran on each physical stage, simulated or measured.

One format serves both the simulator (times in abstract cost ``"units"``) and
executors (``Timeline.from_intervals`` with monotonic-clock seconds), so the same
statistics and pictures apply to both. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping

from .actions import Action, ActionKind
from .checks import check_count

__all__ = ["Event", "Timeline"]

Interval = tuple[int, "Action | str", float, float]


@dataclass(frozen=True)
class Event:
    """``action`` ran on physical ``stage`` (its lane) from ``start`` to ``end``."""

    stage: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; the action in its compact string form (``"1B3.1"``)."""
        return {"stage": self.stage, "action": str(self.action),
                "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        """Inverse of :meth:`to_dict`."""
        try:
            return _event(data["stage"], data["action"], data["start"], data["end"])
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"an event needs 'stage', 'action', 'start' and 'end', got {data!r}"
            ) from exc


def _event(stage: int, action: Action | str, start: float, end: float) -> Event:
    if not isinstance(action, Action):
        action = Action.parse(action)
    return Event(int(stage), action, float(start), float(end))


@dataclass(frozen=True)
class Timeline:
    """Events of one run on ``num_stages`` lanes; ``source`` says where the times come
    from (``"simulated"``, ``"measured"``) and ``unit`` what they count (``"units"``, ``"s"``)."""

    num_stages: int
    events: tuple[Event, ...]
    source: str = "simulated"
    unit: str = "units"

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        check_count("num_stages", self.num_stages)
        for event in self.events:
            if not 0 <= event.stage < self.num_stages:
                raise ValueError(
                    f"event {event.action} is on stage {event.stage}, outside "
                    f"0..{self.num_stages - 1}"
                )
            if event.end < event.start:
                raise ValueError(
                    f"event {event.action} on stage {event.stage} ends ({event.end}) "
                    f"before it starts ({event.start})"
                )

    @classmethod
    def from_intervals(
        cls,
        num_stages: int,
        intervals: Iterable[Interval],
        source: str = "measured",
        unit: str = "s",
    ) -> Timeline:
        """Build a timeline from ``(stage, action, start, end)`` tuples, e.g. monotonic-clock
        seconds recorded by an executor; ``action`` may be an :class:`Action` or its string."""
        return cls(num_stages, tuple(_event(*item) for item in intervals), source, unit)

    # -- statistics ----------------------------------------------------------

    @cached_property
    def start(self) -> float:
        """Earliest event start (0.0 when there are no events)."""
        return min((e.start for e in self.events), default=0.0)

    @cached_property
    def end(self) -> float:
        """Latest event end (0.0 when there are no events)."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        return self.end - self.start

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per stage, the summed duration of its events."""
        totals = [0.0] * self.num_stages
        for event in self.events:
            totals[event.stage] += event.end - event.start
        return tuple(totals)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle: ``1 - sum(busy) / (num_stages * makespan)``."""
        total = self.num_stages * self.makespan
        return 1.0 - sum(self.busy) / total if total > 0 else 0.0

    @cached_property
    def peak_inflight(self) -> tuple[int, ...]:
        """Per stage, the most (chunk, micro-batch) pairs in flight at once: from the
        ``F`` until the last backward action (``W`` when the pair has one, else ``B``)."""
        return tuple(int(p) for p in self.peak_weighted(lambda action: 1.0))

    def peak_weighted(self, weight: Callable[[Action], float]) -> tuple[float, ...]:
        """Like :attr:`peak_inflight`, but each pair counts ``weight(its F action)``,
        e.g. its activation memory."""
        return tuple(_peak(lane, weight) for lane in self.by_stage())

    def by_stage(self) -> tuple[tuple[Event, ...], ...]:
        """Events grouped by stage (lane), each group in start order."""
        return self._lanes

    @cached_property
    def _lanes(self) -> tuple[tuple[Event, ...], ...]:
        lanes: list[list[Event]] = [[] for _ in range(self.num_stages)]
        for event in self.events:
            lanes[event.stage].append(event)
        return tuple(tuple(sorted(lane, key=lambda e: (e.start, e.end))) for lane in lanes)

    # -- serialisation -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; :meth:`from_dict` reads it back."""
        return {
            "num_stages": self.num_stages,
            "source": self.source,
            "unit": self.unit,
            "events": [event.to_dict() for event in self.events],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        """Inverse of :meth:`to_dict`."""
        try:
            events = tuple(Event.from_dict(item) for item in data["events"])
            return cls(data["num_stages"], events, data.get("source", "simulated"),
                       data.get("unit", "units"))
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"a timeline needs 'num_stages' and 'events', got keys {sorted(data)}"
            ) from exc


def _peak(lane: tuple[Event, ...], weight: Callable[[Action], float]) -> float:
    """Most weight in flight on one lane, scanning its events in start order."""
    forward, weight_kind = ActionKind.FORWARD, ActionKind.WEIGHT
    actions = [event.action for event in lane]
    split = {(a.chunk, a.microbatch) for a in actions if a.kind is weight_kind}
    live: dict[tuple[int, int], float] = {}
    total = peak = 0.0
    for action in actions:
        key = (action.chunk, action.microbatch)
        if action.kind is forward:
            live[key] = amount = weight(action)
            total += amount
            peak = max(peak, total)
        elif (action.kind is weight_kind) == (key in split):
            total -= live.pop(key, 0.0)
    return peak
