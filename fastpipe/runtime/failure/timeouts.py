"""The error of a wait that ran past its timeout, built in one place from what was waited for.

Every bounded wait of the runtime (a stage's input in one process, a message or an exchange from
another rank, a collective over the ranks) describes itself as a :class:`Waiting`; its timeout
error names who waited, for what and for how long, the action and micro-batch it feeds, the ranks
it waited on, and the fix. On a distributed pipe the failure board then adds the rank holding the
pipeline up, read from the ranks' liveness records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

from ...errors import PipelineTimeout
from ...schedule import Action

if TYPE_CHECKING:
    from .board import Board

FIX = "raise the pipe's timeout=... if stages are this slow"


@dataclass(frozen=True)
class Waiting:
    """What a wait is for, as its timeout error names it."""

    what: str  # e.g. "the input of action 1F3 (micro-batch 3)"
    timeout: float  # seconds
    rank: Optional[int] = None  # the waiting rank (a distributed pipe)
    stage: Optional[int] = None  # the waiting rank's physical stage, or the waiting stage
    action: Optional[Action] = None  # the action the wait feeds
    peers: Tuple[int, ...] = ()  # the ranks waited on
    detail: str = ""  # said after the ranks waited on, before the fix: "; ..."

    def who(self) -> str:
        """``rank 1 (stage 1)``, ``rank 1`` or ``stage 1``."""
        if self.rank is None:
            return f"stage {self.stage}"
        return f"rank {self.rank}" + (f" (stage {self.stage})" if self.stage is not None else "")

    def sought(self) -> str:
        """``waiting for <what> from rank <peer>``: the wait, in an error's words."""
        if not self.peers:
            return f"waiting for {self.what}"
        ranks = f"rank {self.peers[0]}" if len(self.peers) == 1 else f"ranks {list(self.peers)}"
        return f"waiting for {self.what} from {ranks}"


def timeout_error(waiting: Waiting, board: Optional["Board"] = None) -> PipelineTimeout:
    """The ``PipelineTimeout`` of ``waiting``; with a failure board, naming the rank that holds
    the pipeline up (which this rank then posts for the others)."""
    action = waiting.action
    error = PipelineTimeout(
        f"{waiting.who()} timed out after {waiting.timeout:g}s {waiting.sought()}"
        f"{waiting.detail}: {FIX}",
        stage=action.stage if action is not None else waiting.stage,
        action=str(action) if action is not None else None,
        microbatch=action.microbatch if action is not None else None, rank=waiting.rank)
    if board is None:
        return error
    return board.blame(error, waiting.peers[0] if waiting.peers else None)
