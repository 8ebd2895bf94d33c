"""A model's inputs as one value: positional and keyword inputs in one pytree.

A traced model takes whatever its ``forward`` takes; the pipeline splits and moves inputs as
one pytree, so a traced pipe's first stage takes a :class:`Call` (or what :func:`as_call` reads
as one).
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Call", "as_call"]


class Call(NamedTuple):
    """Positional and keyword inputs of a model, as one pytree (micro-batched like any input)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def as_call(inputs: Any) -> Call:
    """A model's inputs as ``Call``: a ``Call`` as is, a dict as keyword inputs, a tuple as
    positional inputs, anything else as the one positional input."""
    if isinstance(inputs, Call):
        return inputs
    if isinstance(inputs, dict):
        return Call((), dict(inputs))
    if isinstance(inputs, tuple):
        return Call(tuple(inputs), {})
    return Call((inputs,), {})
