"""The executor of one rank of a ``DistributedPipe``, picked by its transport.

``p2p="tagged"``: :class:`~fastpipe.runtime.tagged_executor.TaggedExecutor` (messages sent as
produced, taken when an action needs them); ``p2p="grouped"``:
:class:`~fastpipe.runtime.grouped_executor.GroupedExecutor` (the NCCL program's groups). Both
share :class:`~fastpipe.runtime.rank_executor.RankExecutor`: the step's run, the failure
board and notices, and errors that name the rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..schedule import SkipLink
from .failure.board import Board
from .grouped_executor import GroupedExecutor
from .rank_executor import AfterAction, RankExecutor, Topology, last_gradient_actions
from .tagged_executor import TaggedExecutor

__all__ = ["RankExecutor", "Topology", "distributed_executor", "last_gradient_actions"]


def distributed_executor(topology: Topology, board: Board,
                         after_action: Optional[AfterAction] = None,
                         skips: Sequence[SkipLink] = (), grouped: bool = False) -> RankExecutor:
    """This rank's executor: the grouped runner with ``grouped``, else the tagged one."""
    runner = GroupedExecutor if grouped else TaggedExecutor
    return runner(topology, board, after_action, skips)
