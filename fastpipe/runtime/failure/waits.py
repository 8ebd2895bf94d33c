"""Bounded waits on ``torch.distributed`` work: the one primitive every wait of a rank uses.

A wait either polls the work, so that it never outlives its deadline and reads the failure board
every ``CHECK_EVERY`` seconds (stopping as soon as any rank posted a failure), or, for gloo's
point-to-point works, which report completion only through ``wait`` (and whose timed-out waits
close the connection), blocks in ``wait`` until the deadline. A wait that raised timed out when
its deadline has passed and no rank posted a failure; otherwise the peer was lost, and the board
says why (:meth:`~fastpipe.runtime.failure.board.Board.lost`).
"""
from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ...errors import PipelineAborted, PipelineError
from .timeouts import Waiting, timeout_error

if TYPE_CHECKING:
    from .board import Board

CHECK_EVERY = 0.2  # seconds between looks at the board while waiting
SLACK = 0.01  # seconds: torch rounds a wait's timeout down to whole milliseconds


def wait_until(work: Optional[Any], waiting: Waiting, board: "Board", deadline: float, *,
               blocking: bool = False, stopped: Optional[Callable[[], Optional[str]]] = None,
               done: Optional[Callable[[], bool]] = None, longest_pause: float = 2e-3) -> None:
    """Wait for ``work`` (or until ``done()``) until ``deadline`` (``time.monotonic()``):
    ``blocking`` in its ``wait``, else polling, stopping when the board or ``stopped()`` gives a
    reason. Raises the timeout of ``waiting``, or the error of a lost peer."""
    if not blocking:
        _poll(done or work.is_completed, waiting, board, deadline, stopped, longest_pause)
        if work is None:
            return
    try:
        if blocking:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        else:
            work.wait()  # completed: returns at once, or raises the work's own error
    except RuntimeError as error:
        raise failure_of(error, waiting, board, deadline) from error


def _poll(done: Callable[[], bool], waiting: Waiting, board: "Board", deadline: float,
          stopped: Optional[Callable[[], Optional[str]]], longest_pause: float) -> None:
    pause, next_check = 1e-5, time.monotonic() + CHECK_EVERY
    while not done():
        now = time.monotonic()
        if now >= next_check:
            reason = board.read() or (stopped() if stopped is not None else None)
            if reason is not None:
                raise PipelineAborted(f"rank {board.rank} stopped {waiting.sought()} because "
                                      f"{reason}")
            next_check = now + CHECK_EVERY
        if now >= deadline:
            raise timeout_error(waiting, board)
        time.sleep(pause)
        pause = min(pause * 2, longest_pause)


def failure_of(error: BaseException, waiting: Waiting, board: "Board",
               deadline: float) -> PipelineError:
    """The error of a wait that raised ``error``: its timeout when the deadline has passed and
    no rank posted a failure, else the loss of the peer (named from the liveness records)."""
    if time.monotonic() >= deadline - SLACK and board.read() is None:
        return timeout_error(waiting, board)
    return board.lost(waiting.sought(), error, waiting.peers[0] if waiting.peers else None)


def wait_work(work: Optional[Any], timeout: float, what: str, board: "Board",
              done: Optional[Callable[[], bool]] = None) -> None:
    """Wait, polling, at most ``timeout`` seconds for an asynchronous ``torch.distributed`` work
    (a collective; or until ``done()``); ``what`` names the wait in the error."""
    waiting = Waiting(what, timeout, rank=board.rank,
                      detail="; the peer rank is stuck, dead or much slower")
    wait_until(work, waiting, board, time.monotonic() + timeout, done=done)
