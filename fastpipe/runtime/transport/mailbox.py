"""Keyed mailboxes through which stages hand activations and gradients to each other.

Every mailbox rings its owner's doorbell (a condition shared by the stages one worker thread
runs), so a worker sleeps only when none of its stages can move. Every wait has a timeout, and a
step's mailboxes can be aborted at once so that one failing stage stops all the others.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, List, Optional


class Abort:
    """Shared failure flag of one pipeline step."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._bells: List[threading.Condition] = []

    def register(self, bell: threading.Condition) -> None:
        self._bells.append(bell)

    def trip(self, reason: str) -> None:
        """Record the first failure and wake every waiting worker of the step."""
        if self.reason is None:
            self.reason = reason
        for bell in self._bells:
            with bell:
                bell.notify_all()


class Bell(threading.Condition):
    """A worker's doorbell: a condition that knows whether its worker sleeps on it, so that a
    message for a worker that is awake (the common case) costs no lock and no notify."""

    def __init__(self) -> None:
        super().__init__()
        self.sleepers = 0  # changed only under the lock, by the worker going to sleep


class Mailbox:
    """Values addressed by key to one stage; a put wakes the worker that runs the stage.

    A put stores first and rings only when the worker sleeps: the worker counts itself as a
    sleeper under the bell's lock *before* it looks at its mailboxes, so either it sees the new
    value or the put sees the sleeper and notifies under that lock (no wake-up is lost)."""

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self._items: Dict[Hashable, Any] = {}

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        if self.bell.sleepers:
            with self.bell:
                self.bell.notify()

    def has(self, key: Hashable) -> bool:
        return key in self._items

    def take(self, key: Hashable) -> Any:
        """Remove and return the value under ``key``; the caller checked ``has`` first."""
        return self._items.pop(key)
