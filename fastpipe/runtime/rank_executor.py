"""What every per-rank executor shares: one rank of a ``DistributedPipe`` runs its own program.

A rank runs its stage's program on a :class:`~fastpipe.runtime.executor.LocalExecutor` of one
worker, which it drives as that executor's strategy: the mailboxes of its own stages are local,
those of other ranks' stages belong to the transport, failures elsewhere are read on the failure
board, and the liveness record follows every action. The transports differ in how messages move
(:mod:`.tagged_executor`: tagged point-to-point messages; :mod:`.grouped_executor`: the groups of
the NCCL program). Here: the topology, the step's run (its sends waited for at the end), the
failure notices a failing rank sends, and errors that name this rank.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import PeerLost, PipelineAborted, PipelineError, PipelineTimeout, StageFailure
from ..schedule import Action, ActionKind, Schedule, SkipLink
from .executor import LocalExecutor, Worker
from .failure.board import Board
from .failure.waits import CHECK_EVERY
from .step import StepState
from .transport import backends
from .transport.mailbox import Bell, Mailbox
from .transport.p2p import Channels, SendLog, StepInfo, Transport, TransportError, send_failure
from .transport.wire import Header

AfterAction = Callable[[StepState, Any, Action], None]


@dataclass
class Topology:
    """Where the virtual stages live: ``owner[v]`` is the global rank that holds stage ``v``."""

    owner: Sequence[int]
    rank: int  # this process's global rank
    stage: int  # this rank's physical pipeline stage
    group: Any  # the pipeline process group
    device: torch.device

    def local(self, virtual_stage: int) -> bool:
        return self.owner[virtual_stage] == self.rank


class RankExecutor:
    """Runs this rank's program of a schedule; other ranks run theirs. A transport supplies
    ``learn_microbatches``, ``expect``, ``work`` and the mailbox of a remote stage."""

    watch_every = CHECK_EVERY  # the watchdog reads the failure board this often
    inline = False  # the watchdog must read the board while the worker waits on peers
    surrounds_actions = True  # the liveness record, the after-action hook

    def __init__(self, topology: Topology, board: Board,
                 after_action: Optional[AfterAction] = None,
                 skips: Sequence[SkipLink] = ()) -> None:
        self.skips = tuple(sorted(skips))  # every skip connection of the pipeline
        self.topology = topology
        self.rank = topology.rank
        self.board = board
        self._after_action = after_action
        self.info = StepInfo()
        self.transport = Transport(topology.group, topology.device, topology.rank,
                                   Channels(self.skips), self.info)
        self.sends = SendLog()
        self._notices = SendLog()  # failure notices, never waited for
        self._ranks = dist.get_process_group_ranks(topology.group)  # by physical stage
        self.side = backends.side_channel(topology.group)  # gloo: headers, notices (CPU)
        self._bell = Bell()
        self._local = LocalExecutor([[topology.stage]], strategy=self, rank=topology.rank)

    # ---------------------------------------------------------------- the transport's part
    def learn_microbatches(self, src_rank: int, step: StepState) -> Header:
        """Receive the step's first message from ``src_rank`` before the step's size is known
        here, and return its header (it carries the micro-batch count and batch size)."""
        raise NotImplementedError

    def expect(self, schedule: Schedule, rows: Sequence[Sequence[Action]],
               learned_from: Optional[int]) -> None:
        """Prepare the receives of the step that runs ``rows`` of ``schedule``."""
        raise NotImplementedError

    def work(self, step: StepState, worker: Worker) -> None:
        """Run this rank's program (the local executor's worker)."""
        raise NotImplementedError

    def _remote_mailbox(self, virtual_stage: int) -> Any:
        """Where the messages for another rank's stage go."""
        raise NotImplementedError

    # ---------------------------------------------------------------- one step
    def wire(self, step: StepState, schedule: Schedule) -> None:
        """Give every virtual stage a mailbox: local ones for this rank's stages, the
        transport's for the others'."""
        bell = Bell()
        step.mailboxes = [Mailbox(bell) if self.topology.local(v) else self._remote_mailbox(v)
                          for v in range(schedule.num_virtual_stages)]
        step.abort.register(bell)
        self._bell = bell
        self.transport.reads = step.reads  # the step's reads of device buffers, counted

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        """Run this rank's program; wait for its sends; every error names the rank. A failure
        caused by another rank (one that exited, froze or never started) is posted naming it."""
        try:
            with self.peers_named("running the step"):
                self._local.run(programs, step, schedule)
                self._flush_sends(step.config.timeout)
            self._doing("finished its actions")
        except PipelineError as error:
            culprit = getattr(error, "culprit", None)
            if culprit is None and isinstance(error, PipelineAborted):  # pass the first on
                culprit = self.board.read() or step.abort.reason
            self.fail(culprit or f"rank {self.topology.rank} (stage {self.topology.stage}) "
                                 f"failed: {error}")
            raise _with_rank(error, self.topology.rank) from error.__cause__

    def _flush_sends(self, timeout: float) -> None:
        """Wait until every message of the step has left (its buffers may then be reused)."""
        works, self.sends.works = self.sends.works, []
        for work, _, what in works:
            if work is None:  # a coalesced group's tensors, kept until here
                continue
            self.board.check()
            try:  # gloo reports a send's completion only through wait()
                work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as error:
                raise self.board.lost(f"sending the {what} (within {timeout:g}s)",
                                      error) from None

    def fail(self, reason: str) -> None:
        """Tell every rank: post ``reason`` on the board, and send a failure notice to every
        other rank of the pipeline (any of them may be blocked on a message from this one),
        over the side channel (gloo, CPU tensors, also beside NCCL)."""
        self.board.publish(reason)
        for peer in [r for r in self._ranks if r != self.topology.rank]:
            try:
                send_failure(peer, self.side, torch.device("cpu"), reason,
                             self._notices)  # kept: a dropped send may never leave
            except Exception:  # noqa: BLE001 - a peer that is gone needs no notice
                pass

    @contextlib.contextmanager
    def peers_named(self, doing: str) -> Iterator[None]:
        """Turn a failed send or receive into an error naming the rank responsible."""
        try:
            yield
        except TransportError as error:
            raise self.board.lost(doing, error.__cause__ or error, error.peer) from None

    def _doing(self, what: str) -> None:
        """Tell the liveness record what this rank is doing in the current step."""
        liveness = self.board.liveness
        liveness.at(liveness.step, what)

    # ------------------------------------------------------------ the local executor's strategy
    def check_programs(self, programs: Sequence[Sequence[Action]],
                       groups: Sequence[Sequence[int]]) -> None:
        if self.topology.stage >= len(programs):
            raise ValueError(f"no program for stage {self.topology.stage}")

    def skip_links(self, step: StepState) -> Tuple[SkipLink, ...]:
        return self.skips

    def wire_workers(self, programs: Sequence[Sequence[Action]], step: StepState,
                     schedule: Schedule, groups: Sequence[Sequence[int]]
                     ) -> List[Bell]:
        """The mailboxes are wired (:meth:`wire`): only the progress record is new."""
        step.progress = [("not started" if s == self.topology.stage else "on another rank", None)
                         for s in range(len(programs))]
        step.busy = [0.0]
        return [self._bell]

    def failure_elsewhere(self) -> Optional[str]:
        return self.board.read()

    @contextlib.contextmanager
    def around_action(self, step: StepState, stage: Any, action: Action) -> Iterator[None]:
        """The liveness record names the action; after it, the driver's hook (on a GPU, a
        gradient all-reduce ordered after the backward)."""
        self._doing(f"running action {action} (micro-batch {action.microbatch})")
        yield
        if self._after_action is not None:
            with stage.context():
                self._after_action(step, stage, action)


def _with_rank(error: PipelineError, rank: int) -> PipelineError:
    """The same error, its message prefixed with the rank and ``rank`` set."""
    text = str(error)
    message = text if text.startswith(f"rank {rank}") else f"rank {rank}: {text}"
    if isinstance(error, PipelineTimeout):
        new: PipelineError = PipelineTimeout(message, stage=error.stage, action=error.action,
                                             microbatch=error.microbatch, rank=rank)
    elif isinstance(error, StageFailure):
        new = StageFailure(message, stage=error.stage, action=error.action,
                           microbatch=error.microbatch)
    elif isinstance(error, PeerLost):
        new = PeerLost(message, culprit=error.culprit)
    else:
        new = type(error)(message)
    new.rank = rank  # type: ignore[attr-defined]
    if getattr(error, "culprit", None) is not None:
        new.culprit = error.culprit  # type: ignore[attr-defined]
    return new


def last_gradient_actions(program: Sequence[Action], schedule: Schedule) -> Dict[Action, int]:
    """For each virtual stage of ``program``, its last action that adds weight gradients (its
    last W, or its last B when it has no W): when it ends, the stage's gradients are final."""
    last: Dict[int, Action] = {}
    for action in program:
        if action.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT):
            v = schedule.virtual_stage_of(action)
            if action.kind == ActionKind.WEIGHT or (v, action.microbatch) not in \
                    schedule.split_backwards:
                last[v] = action
    return {action: v for v, action in last.items()}
