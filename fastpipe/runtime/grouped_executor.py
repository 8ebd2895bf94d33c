"""The grouped runner: one rank runs its NCCL program, its messages moving in the program's groups.

With ``p2p="grouped"`` a rank's program is its row of :func:`fastpipe.schedule.lower_nccl`:
compute actions and, between them, communication groups
(:class:`~fastpipe.runtime.transport.grouped.GroupedExchange`). A message produced for another
rank waits in a :class:`~fastpipe.runtime.transport.grouped.Stash` until its group; a group's
receives are finished just before the first action they feed, so the next group's transfers
overlap the compute. On a GPU the groups run on a communication stream ordered against the local
stages' streams by CUDA events, and the host waits only for the headers, which come over the
side channel (gloo, CPU tensors): it never reads a device buffer, so it runs ahead of the GPU
(``pipe.last_step.host_reads`` counts such reads: none of them here).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import PipelineAborted, PipelineError
from ..schedule import Action, Comm, CommGroup, CommKind, Op, Payload, Schedule, SkipLink
from ..schedule.lower import comm_fields
from ..schedule.nccl import pair_key
from .executor import Worker
from .failure.board import Board
from .failure.timeouts import Waiting
from .failure.waits import wait_until
from .lowering import Route, is_ready, lowering, nccl_programs
from .rank_executor import AfterAction, RankExecutor, Topology
from .step import StepState
from .transport.grouped import GroupedExchange, Posted, Stash
from .transport.p2p import PeerFailed
from .transport.wire import Header


class GroupedExecutor(RankExecutor):
    """Runs this rank's NCCL program: its actions, and its groups of messages in order."""

    def __init__(self, topology: Topology, board: Board,
                 after_action: Optional[AfterAction] = None,
                 skips: Sequence[SkipLink] = ()) -> None:
        super().__init__(topology, board, after_action, skips)
        self.exchange = GroupedExchange(self.transport, self.side, topology.stage, self._ranks,
                                        self.sends)
        self._program: Tuple[Op, ...] = ()
        self._learned: Optional[CommGroup] = None  # the group taken to learn the step's size

    def _remote_mailbox(self, virtual_stage: int) -> Stash:
        return Stash(virtual_stage, self.exchange.outgoing)

    def learn_microbatches(self, src_rank: int, step: StepState) -> Header:
        """Run the first exchange of this rank's program before the step's size is known: the
        receives of its first action (a forward of micro-batch 0 of its first stage), which do
        not depend on the size; the program skips that group when it gets there."""
        owner, ranks = self.topology.owner, self._ranks
        entry = min(v for v in range(len(owner)) if owner[v] == self.rank)
        stage = self.topology.stage
        sources = [(ranks.index(owner[entry - 1]), None)] + [
            (ranks.index(owner[link.src]), link) for link in self.skips
            if link.dst == entry and owner[link.src] != self.rank]
        ops = [Comm(CommKind.RECV, Payload.ACT, peer, 0, entry, link) for peer, link in sources]
        group = CommGroup(tuple(sorted(ops, key=lambda op: pair_key(stage, comm_fields(op)))))
        self._doing(f"waiting for the first message of the step from rank {src_rank}")
        headers = self._finish(step, self._post(step, group), None)
        self._learned = group
        return headers[[op.peer for op in group.ops].index(ranks.index(src_rank))]

    def expect(self, schedule: Schedule, rows: Sequence[Sequence[Action]],
               learned_from: Optional[int]) -> None:
        """This rank's NCCL program for the step (its groups post the receives)."""
        self._program = nccl_programs(lowering(schedule, rows, self.skips))[self.topology.stage]

    # ---------------------------------------------------------------- the program
    def work(self, step: StepState, worker: Worker) -> None:
        """Walk the program: its groups in order (a group's phases before any other group's),
        each action once the group in flight delivered what it needs."""
        entries = iter(worker.rows[worker.stages[0]])
        posted: Optional[Posted] = None  # a group in flight (at most one: phases stay paired)
        for op in self._program:
            if step.abort.reason is not None:
                raise PipelineAborted(f"rank {self.rank} stopped because {step.abort.reason}")
            if isinstance(op, CommGroup):
                posted = self._group(step, op, posted)
            else:
                posted = self._action(step, worker, op, next(entries), posted)
        if posted is not None:
            self._finish(step, posted, None)
        if self.exchange.outgoing:  # a message its program never sent: refuse, never drop it
            left = sorted(map(str, self.exchange.outgoing))
            self.exchange.outgoing.clear()
            raise PipelineError(f"rank {self.rank} ended the step with unsent messages {left}: "
                                f"the program and the schedule disagree")

    def _group(self, step: StepState, group: CommGroup,
               posted: Optional[Posted]) -> Optional[Posted]:
        """Post ``group`` after finishing the one in flight; returns the group now in flight."""
        if self._learned is not None:  # run before the step's size was known
            learned, self._learned = self._learned, None
            if group != learned:
                raise PipelineError(f"rank {self.rank} learned the step's size from the "
                                    f"exchange {learned}, but its program starts with {group}")
            return posted
        if posted is not None:
            self._finish(step, posted, None)
        self._doing(f"in the exchange {group}")
        posted = self._post(step, group)
        if not posted.receives:  # sends only: their second phase leaves now
            self._finish(step, posted, None)
            return None
        return posted

    def _action(self, step: StepState, worker: Worker, op: Op, entry: Tuple[Action, Route],
                posted: Optional[Posted]) -> Optional[Posted]:
        """Run the program's next action (finishing the group in flight first if it feeds it);
        returns the group still in flight."""
        action, route = entry
        if posted is not None and posted.feeds(
                (route.virtual_stage, action.kind, action.microbatch)):
            self._finish(step, posted, action)
            posted = None
        if action != op or not is_ready(step, route):
            raise PipelineError(f"rank {self.rank} reached action {op} without its "
                                f"messages: the program and the schedule disagree")
        worker.run(step.config.stages[route.virtual_stage], action)
        return posted

    # ---------------------------------------------------------------- one group
    def _post(self, step: StepState, group: CommGroup) -> Posted:
        """Post a group's first phase (on a GPU: on the communication stream, after every
        local stage's work so far, since its sends were computed there)."""
        self.exchange.streams.stages = self._local_streams(step)
        with self.peers_named(f"posting the exchange {group}"):
            return self.exchange.post(group)

    def _finish(self, step: StepState, posted: Posted, action: Optional[Action]) -> List[Header]:
        """Wait for a posted group and deliver what it brought (on a GPU, the local stages'
        streams then wait for the communication stream: CUDA events, no host sync); errors
        name this rank and the action the group feeds. The host's waits are all on gloo works
        (the side channel's; on the CPU the data's too), which report only through a wait
        bounded by the deadline (see failure.waits); a notice ends them early."""
        group = posted.group
        feeds = (f" (for action {action}, micro-batch {action.microbatch})"
                 if action is not None else "")
        deadline = time.monotonic() + step.config.timeout
        peers = tuple(self._ranks[p] for p in sorted({op.peer for op in group.ops}))

        def wait(work: Any, what: str) -> None:
            waiting = Waiting(f"{what}{feeds}", step.config.timeout, rank=self.rank,
                              stage=self.topology.stage, action=action, peers=peers)
            wait_until(work, waiting, self.board, deadline, blocking=True,
                       stopped=lambda: step.abort.reason)

        self.exchange.streams.stages = self._local_streams(step)
        try:
            with self.peers_named(f"running the exchange {group}"):
                return self.exchange.finish(posted, step.mailboxes, wait)
        except PeerFailed as failure:
            raise PipelineAborted(f"rank {self.rank} stopped in the exchange {group}{feeds} "
                                  f"because {failure}") from None

    # ---------------------------------------------------------------- CUDA streams
    def _local_streams(self, step: StepState) -> List[Any]:
        """The local stages' streams, which the exchange orders its stream against (none on
        the CPU)."""
        return [step.config.stages[v].stream for v in range(len(step.config.stages))
                if self.topology.local(v) and getattr(step.config.stages[v], "stream", None)
                is not None]
