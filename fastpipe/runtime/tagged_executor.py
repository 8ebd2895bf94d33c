"""The tagged runner: one rank's program, its messages sent as produced over tagged p2p.

The mailboxes of other ranks' stages are :class:`~fastpipe.runtime.transport.p2p.Outbox`
objects that send, and when the next action lacks a message, the worker takes it (and any sent
before it) from the sending peer's :class:`~fastpipe.runtime.transport.p2p.Inbox`, whose
receives are posted ahead of the compute. Which messages a step takes from which peer, and which
peer sends a missing one, come from the step's lowered programs
(:mod:`fastpipe.runtime.lowering`), as on one process; the handlers (F, B, W) are the very same.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Dict, Optional, Sequence

import torch.distributed as dist

from ..errors import PipelineAborted, PipelineError
from ..schedule import Action, Schedule, SkipLink
from .executor import Pending, Worker, run_when_ready
from .failure.board import Board
from .failure.timeouts import Waiting, timeout_error
from .failure.waits import failure_of
from .lowering import Route, is_ready, lowering
from .rank_executor import AfterAction, RankExecutor, Topology
from .step import StepState
from .transport.p2p import Inbox, Outbox, PeerFailed, PeerPayloads
from .transport.wire import Header


class TaggedExecutor(RankExecutor):
    """Runs this rank's program; its messages go over tagged point-to-point sends."""

    def __init__(self, topology: Topology, board: Board,
                 after_action: Optional[AfterAction] = None,
                 skips: Sequence[SkipLink] = ()) -> None:
        super().__init__(topology, board, after_action, skips)
        self._inboxes: Dict[int, Inbox] = {}  # metadata caches live across steps
        # payload sizes sent to / received from each peer, mirrored on the other side
        prepost = dist.get_backend(topology.group) == "gloo"
        self._sent_sizes, self._received_sizes = PeerPayloads(prepost), PeerPayloads(prepost)
        self._outboxes: Dict[int, Outbox] = {}

    def inbox(self, src_rank: int) -> Inbox:
        if src_rank not in self._inboxes:
            stage = self._ranks.index(src_rank)
            self._inboxes[src_rank] = Inbox(src_rank, stage, self.transport,
                                            self._received_sizes)
        return self._inboxes[src_rank]

    def _remote_mailbox(self, virtual_stage: int) -> Outbox:
        if virtual_stage not in self._outboxes:
            self._outboxes[virtual_stage] = Outbox(
                virtual_stage, self.topology.owner[virtual_stage], self.transport, self.sends,
                self._sent_sizes)
        return self._outboxes[virtual_stage]

    def learn_microbatches(self, src_rank: int, step: StepState) -> Header:
        inbox = self.inbox(src_rank)
        inbox.begin(None)
        self._doing(f"waiting for the first message of the step from rank {src_rank}")
        return self._receive(step, inbox, "the first message of the step",
                             time.monotonic() + step.config.timeout)

    def expect(self, schedule: Schedule, rows: Sequence[Sequence[Action]],
               learned_from: Optional[int]) -> None:
        """Post the first receive from every peer that sends this rank something in the step
        that runs ``rows`` of ``schedule`` (as many messages as its lowered program takes)."""
        owner, rank = self.topology.owner, self.topology.rank
        lowered = lowering(schedule, rows, self.skips)
        counts = Counter(owner[v] for v in lowered.sources(self.topology.stage)
                         if owner[v] != rank)
        with self.peers_named("posting the step's receives"):
            for inbox in self._inboxes.values():
                if inbox.src_rank != learned_from:
                    inbox.begin(0)
            for src_rank, count in counts.items():
                if src_rank == learned_from:
                    self.inbox(src_rank).expect(count - 1)
                else:
                    self.inbox(src_rank).begin(count)

    def work(self, step: StepState, worker: Worker) -> None:
        """The local executor's loop; a missing message is taken from the peer that sends it."""
        run_when_ready(step, worker, self._take_missing)

    def _take_missing(self, step: StepState, worker: Worker, pending: Pending,
                      deadline: float) -> None:
        """Take messages from the peer that sends what the next action needs, until it is
        ready (the peer sent them in this order)."""
        action, route = pending[0]
        what = f"the input of action {action} (micro-batch {action.microbatch})"
        self._doing(f"waiting for {what}")
        while not is_ready(step, route):
            if step.abort.reason is not None:
                raise PipelineAborted(f"stage {action.stage} stopped waiting for {what} because "
                                      f"{step.abort.reason}")
            src = self._source_of_missing(step, action, route)
            self._receive(step, self.inbox(src), what, deadline, action)

    def _source_of_missing(self, step: StepState, action: Action, route: Route) -> int:
        """The rank that sends the first message ``action`` still lacks."""
        box = step.mailboxes[route.virtual_stage]
        for key, src_stage in zip(route.waits, route.sources):
            if not box.has(key):
                if self.topology.local(src_stage):
                    raise PipelineError(f"stage {route.virtual_stage} waits for '{key}' from "
                                        f"stage {src_stage} on this rank, which has not sent it: "
                                        f"the schedule runs them out of order")
                return self.topology.owner[src_stage]
        raise PipelineError(f"action {action} is not ready but lacks no message")

    def _receive(self, step: StepState, inbox: Inbox, what: str, deadline: float,
                 action: Optional[Action] = None) -> Header:
        """One message from ``inbox``, with errors that name this rank, the peer and ``what``
        this rank waited for."""
        waiting = Waiting(what, step.config.timeout, rank=self.rank, stage=self.topology.stage,
                          action=action, peers=(inbox.src_rank,))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timeout_error(waiting, self.board)
        try:
            return inbox.receive_one(step.mailboxes, remaining)
        except PeerFailed as failure:
            raise PipelineAborted(f"rank {self.rank} stopped {waiting.sought()} because "
                                  f"{failure}") from None
        except RuntimeError as error:
            raise failure_of(error, waiting, self.board, deadline) from error
