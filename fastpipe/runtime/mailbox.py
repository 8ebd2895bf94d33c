"""Keyed mailboxes through which stages hand activations and gradients to each other.

Every wait has a timeout, and every mailbox of a step can be aborted at once so that one failing
stage stops all the others instead of leaving them blocked.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Hashable, Optional

from ..errors import PipelineAborted, PipelineTimeout


class Abort:
    """Shared failure flag of one pipeline step."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._boxes: list = []

    def register(self, box: "Mailbox") -> None:
        self._boxes.append(box)

    def trip(self, reason: str) -> None:
        """Record the first failure and wake every waiter of the step."""
        if self.reason is None:
            self.reason = reason
        for box in self._boxes:
            box.wake()


class Mailbox:
    """Values addressed by key to one stage; ``get`` blocks until the key arrives."""

    def __init__(self, owner: int, abort: Abort) -> None:
        self.owner = owner
        self._abort = abort
        self._items: Dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        abort.register(self)

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def get(self, key: Hashable, timeout: float, action: str, microbatch: int) -> Any:
        """Take the value under ``key``, waiting at most ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self._abort.reason is not None:
                    raise PipelineAborted(
                        f"stage {self.owner} stopped waiting for {action} (micro-batch "
                        f"{microbatch}) because {self._abort.reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipelineTimeout(
                        f"stage {self.owner} timed out after {timeout:g}s waiting for the input of "
                        f"action {action} (micro-batch {microbatch}); the stage that should send it "
                        f"is stuck or slow: raise Pipe(timeout=...) if stages are this slow",
                        stage=self.owner, action=action, microbatch=microbatch)
                self._cond.wait(remaining)
            return self._items.pop(key)
