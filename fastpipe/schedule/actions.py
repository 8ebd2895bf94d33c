"""Actions: one F, B or W of one micro-batch on one chunk of one stage.

An action is plain, hashable data with a compact text form (``"0F3"``, ``"1B2.1"``).
Generators and analyses build many of them, so :func:`trusted_action` builds one without the
checks and :func:`gc_paused` keeps the cyclic garbage collector out of the way meanwhile.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

from .checks import check_count

__all__ = ["Action", "ActionKind", "B", "F", "W", "gc_paused", "trusted_action"]


class ActionKind(str, Enum):
    """What a compute action does to one micro-batch on one chunk."""

    FORWARD = "F"
    """Forward pass."""
    BACKWARD = "B"
    """Backward pass: input and weight gradients, unless the schedule also has
    a ``W`` for the same chunk and micro-batch (zero-bubble), in which case
    ``B`` computes the input gradient only."""
    WEIGHT = "W"
    """Weight-gradient pass of zero-bubble schedules (not generated yet)."""

    def __str__(self) -> str:
        return self.value

    # The value's own (C) hash, not Enum's Python-level hash of the name: an action kind is
    # part of the keys the runtime looks up per action. Equal members and strings ("F") hash
    # alike, as their equality says.
    __hash__ = str.__hash__


F = ActionKind.FORWARD
B = ActionKind.BACKWARD
W = ActionKind.WEIGHT

_ACTION_RE = re.compile(r"(\d+)([FBW])(\d+)(?:\.(\d+))?")
_ACTION_FORM = "'<stage><F|B|W><micro-batch>[.<chunk>]', e.g. '0F3' or '1B2.1'"


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small acyclic objects (its
    generation scans would otherwise dominate large schedules); restore its previous state."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Action:
    """One compute step: ``kind`` of ``microbatch`` on ``chunk`` of physical ``stage``.

    The compact string form is ``"0F3"`` (stage 0, forward, micro-batch 3), with
    a ``".c"`` suffix when the chunk is not 0: ``"1F3.1"``.
    """

    stage: int
    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if type(self.kind) is not ActionKind:
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                raise ValueError(
                    f"Action kind must be one of 'F', 'B', 'W', got {self.kind!r}"
                ) from None
        stage, microbatch, chunk = self.stage, self.microbatch, self.chunk
        if (type(stage) is int and type(microbatch) is int and type(chunk) is int
                and stage >= 0 and microbatch >= 0 and chunk >= 0):
            return  # the common case, kept cheap: schedules build many actions
        for name in ("stage", "microbatch", "chunk"):
            check_count(f"Action.{name}", getattr(self, name), minimum=0)

    def __str__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.stage}{self.kind.value}{self.microbatch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form produced by ``str(action)``."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected {_ACTION_FORM}")
        stage, kind, microbatch, chunk = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch), int(chunk or 0))

    def with_kind(self, kind: ActionKind) -> Action:
        """The same stage, micro-batch and chunk with another kind."""
        if type(kind) is ActionKind:
            return trusted_action(self.stage, kind, self.microbatch, self.chunk)
        return Action(self.stage, kind, self.microbatch, self.chunk)


_new_object, _set = object.__new__, object.__setattr__


def trusted_action(stage: int, kind: ActionKind, microbatch: int, chunk: int = 0) -> Action:
    """``Action(stage, kind, microbatch, chunk)`` for values already known to be valid (an
    :class:`ActionKind` and non-negative ints), without the checks: generators build many."""
    action = _new_object(Action)
    _set(action, "stage", stage)
    _set(action, "kind", kind)
    _set(action, "microbatch", microbatch)
    _set(action, "chunk", chunk)
    return action
