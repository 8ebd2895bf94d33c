"""The checks every schedule generator shares, and the error a bad schedule raises.

Generators report bad sizes the same way (:func:`check_count`), and those that place a fixed
number of chunks per stage say which schedule takes other counts (:func:`require_chunks`).
"""

from __future__ import annotations

__all__ = ["ScheduleError", "check_count", "require_chunks"]


class ScheduleError(ValueError):
    """A schedule is malformed, inconsistent or would deadlock."""


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum``; raise naming ``name`` otherwise.

    Shared argument check so every generator reports bad sizes the same way.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_chunks(schedule: str, virtual_stages: object, chunks: int, alternative: str) -> None:
    """Reject a ``virtual_stages`` other than the ``chunks`` per stage that ``schedule`` places,
    pointing to an ``alternative`` schedule that takes other counts."""
    if check_count("virtual_stages", virtual_stages) != chunks:
        what = "one chunk" if chunks == 1 else f"{chunks} chunks"
        raise ValueError(f"{schedule} places {what} per stage: virtual_stages must be {chunks}, "
                         f"got {virtual_stages}; use schedule {alternative!r} for other counts")
