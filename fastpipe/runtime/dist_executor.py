"""The distributed executor: one rank runs its own stage's program, messages go over p2p.

It is the local executor with different wiring: the mailboxes of other ranks' stages are
:class:`~fastpipe.runtime.transport.p2p.Outbox` objects that send, and when the next action lacks a
message, the worker takes it (and any sent before it) from the sending peer's
:class:`~fastpipe.runtime.transport.p2p.Inbox`, whose receives are posted ahead of the compute.
Which
messages a step takes from which peer, and which peer sends a missing one, come from the
step's lowered programs (:mod:`fastpipe.runtime.lowering`), as on one process. The
handlers (F, B, W) are the very same. A failing rank sends its peers a failure notice and posts
it on the failure board, which the caller's thread watches while the step runs; every error
names this rank.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import PeerLost, PipelineAborted, PipelineError, PipelineTimeout, StageFailure
from ..schedule import (Action, ActionKind, Comm, CommGroup, CommKind, Op, Payload, Schedule,
                        SkipLink)
from ..schedule.nccl import pair_key
from ..schedule.lower import comm_fields
from .failure.board import CHECK_EVERY, Board
from .executor import LocalExecutor, Rows
from .transport.grouped import GroupedExchange, Posted, Stash
from .lowering import Route, is_ready, lowering, nccl_programs
from .transport.mailbox import Mailbox
from .transport.p2p import (Channels, Inbox, Outbox, PeerFailed, PeerPayloads, SendLog, StepInfo,
    Transport, TransportError, send_failure)
from .step import StepState
from .transport.wire import Header


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


class DistributedExecutor(LocalExecutor):
    """Runs this rank's program of a schedule; other ranks run theirs."""

    def __init__(self, topology: Topology, board: Board,
                 after_action: Optional[Callable[[StepState, Any, Action], None]] = None,
                 skips: Sequence[SkipLink] = (), grouped: bool = False) -> None:
        super().__init__([[topology.stage]])
        self.skips = tuple(sorted(skips))  # every skip connection of the pipeline
        self.topology = topology
        self.rank = topology.rank
        self.board = board
        self.after_action = after_action
        self.info = StepInfo()
        self.transport = Transport(topology.group, topology.device, topology.rank,
                                   Channels(self.skips), self.info)
        self._inboxes: Dict[int, Inbox] = {}  # metadata caches live across steps
        # payload sizes sent to / received from each peer, mirrored on the other side
        prepost = dist.get_backend(topology.group) == "gloo"
        self._sent_sizes, self._received_sizes = PeerPayloads(prepost), PeerPayloads(prepost)
        self._outboxes: Dict[int, Outbox] = {}
        self.sends = SendLog()
        self._notices = SendLog()  # failure notices, never waited for
        # p2p="grouped": this rank runs its NCCL program, messages move in its groups
        self._ranks = dist.get_process_group_ranks(topology.group)  # by physical stage
        self.exchange = (GroupedExchange(self.transport, topology.stage, self._ranks,
                                         self.sends) if grouped else None)
        self._program: Tuple[Op, ...] = ()
        self._learned: Optional[CommGroup] = None  # the group taken to learn the step's size
        self._comm_stream: Optional[Any] = None  # CUDA: where exchanges are posted

    # ---------------------------------------------------------------- receiving
    def inbox(self, src_rank: int) -> Inbox:
        if src_rank not in self._inboxes:
            stage = self._ranks.index(src_rank)
            self._inboxes[src_rank] = Inbox(src_rank, stage, self.transport,
                                            self._received_sizes)
        return self._inboxes[src_rank]

    def learn_microbatches(self, src_rank: int, step: StepState) -> Header:
        """Receive the step's first message from ``src_rank`` before the step's size is known
        here, and return its header (it carries the micro-batch count and batch size)."""
        if self.exchange is not None:
            return self._learn_grouped(src_rank, step)
        inbox = self.inbox(src_rank)
        inbox.begin(None)
        self._doing(f"waiting for the first message of the step from rank {src_rank}")
        return self._receive(step, inbox, "the first message of the step",
                             time.monotonic() + step.timeout)

    def expect(self, schedule: Schedule, rows: Sequence[Sequence[Action]],
               learned_from: Optional[int]) -> None:
        """Post the first receive from every peer that sends this rank something in the step
        that runs ``rows`` of ``schedule`` (as many messages as its lowered program takes)."""
        owner, rank = self.topology.owner, self.topology.rank
        lowered = lowering(schedule, rows, self.skips)
        if self.exchange is not None:  # the program's groups post the receives
            self._program = nccl_programs(lowered)[self.topology.stage]
            return
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

    @contextlib.contextmanager
    def peers_named(self, doing: str) -> Iterator[None]:
        """Turn a failed send or receive into an error naming the rank responsible."""
        try:
            yield
        except TransportError as error:
            raise self.board.lost(doing, error.__cause__ or error, error.peer) from None

    @staticmethod
    def _where(action: Action) -> Dict[str, Any]:
        return {"stage": action.stage, "action": str(action), "microbatch": action.microbatch}

    def _receive(self, step: StepState, inbox: Inbox, what: str, deadline: float,
                 action: Optional[Action] = None) -> Header:
        """One message from ``inbox``, with errors that name this rank, the peer and ``what``
        this rank waited for."""
        remaining = deadline - time.monotonic()
        where = self._where(action) if action is not None else {}
        if remaining <= 0:
            raise self.board.blame(PipelineTimeout(
                f"rank {self.topology.rank} timed out after {step.timeout:g}s waiting for {what} "
                f"from rank {inbox.src_rank}: raise timeout=... if stages are this slow",
                rank=self.topology.rank, **where), inbox.src_rank)
        try:
            return inbox.receive_one(step.mailboxes, remaining)
        except PeerFailed as failure:
            raise PipelineAborted(f"rank {self.topology.rank} stopped waiting for {what} "
                                  f"because {failure}") from None
        except RuntimeError as error:
            if "timed out" in str(error).lower() and self.board.read() is None:
                raise self.board.blame(PipelineTimeout(
                    f"rank {self.topology.rank} timed out after {step.timeout:g}s waiting for "
                    f"{what} from rank {inbox.src_rank}: raise timeout=... if stages are this "
                    f"slow", rank=self.topology.rank, **where), inbox.src_rank) from error
            raise self.board.lost(f"waiting for {what} from rank {inbox.src_rank}", error,
                                  inbox.src_rank) from None

    def _sleep(self, step: StepState, group: List[int], rows: Rows, cursors: Dict[int, int],
               bell: threading.Condition, deadline: float) -> None:
        """Instead of sleeping: take messages from the peer that sends what the next action
        needs, until it is ready (the peer sent them in this order)."""
        s = group[0]
        action, route = rows[s][cursors[s]]
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

    # ---------------------------------------------------------------- grouped (NCCL programs)
    def _learn_grouped(self, src_rank: int, step: StepState) -> Header:
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
        headers = self._exchange(step, group, None)
        self._learned = group
        return headers[[op.peer for op in group.ops].index(ranks.index(src_rank))]

    def _exchange(self, step: StepState, group: CommGroup,
                  action: Optional[Action]) -> List[Header]:
        """One group of the program, posted and finished; errors name this rank and the
        action it feeds."""
        return self._finish(step, self._post(step, group), action)

    def _post(self, step: StepState, group: CommGroup) -> Posted:
        """Post a group's first phase (on a GPU: on the communication stream, after every
        local stage's work so far, since its sends were computed there)."""
        assert self.exchange is not None
        with self.peers_named(f"posting the exchange {group}"), self._comm_stream_after(step):
            return self.exchange.post(group)

    def _finish(self, step: StepState, posted: Posted, action: Optional[Action]) -> List[Header]:
        """Wait for a posted group and deliver what it brought (on a GPU, the local stages'
        streams then wait for the communication stream: CUDA events, no host sync)."""
        assert self.exchange is not None
        group = posted.group
        where = self._where(action) if action is not None else {}
        feeds = (f" (for action {action}, micro-batch {action.microbatch})"
                 if action is not None else "")
        deadline = time.monotonic() + step.timeout

        def wait(work: Any, what: str) -> None:
            self._wait_exchange(work, f"{what}{feeds}", step, deadline, group, where)

        try:
            with self.peers_named(f"running the exchange {group}"), \
                    self._comm_stream_before(step):
                return self.exchange.finish(posted, step.mailboxes, wait)
        except PeerFailed as failure:
            raise PipelineAborted(f"rank {self.rank} stopped in the exchange {group}{feeds} "
                                  f"because {failure}") from None

    def _local_streams(self, step: StepState) -> List[Any]:
        return [step.stages[v].stream for v in range(len(step.stages))
                if self.topology.local(v) and getattr(step.stages[v], "stream", None)
                is not None]

    @contextlib.contextmanager
    def _comm_stream_after(self, step: StepState) -> Iterator[None]:
        """On a GPU: run the block on the communication stream, ordered after every local
        stage's stream (NCCL runs a group on its own stream, ordered after this one)."""
        if self.topology.device.type != "cuda":
            yield
            return
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(self.topology.device)
        for stream in self._local_streams(step):
            self._comm_stream.wait_stream(stream)
        with torch.cuda.stream(self._comm_stream):
            yield

    @contextlib.contextmanager
    def _comm_stream_before(self, step: StepState) -> Iterator[None]:
        """On a GPU: run the block on the communication stream, then order every local
        stage's stream after it (the tensors it received are used there; the caching
        allocator learns it through ``record_stream``)."""
        if self.topology.device.type != "cuda":
            yield
            return
        assert self.exchange is not None and self._comm_stream is not None
        streams = self._local_streams(step)
        self.exchange.consumer_streams = streams
        with torch.cuda.stream(self._comm_stream):
            yield
        for stream in streams:
            stream.wait_stream(self._comm_stream)

    def _wait_exchange(self, work: Any, what: str, step: StepState, deadline: float,
                       group: CommGroup, where: Dict[str, Any]) -> None:
        """Wait for ``work`` until the deadline: blocking on gloo (whose point-to-point works
        report completion only through ``wait``, and whose timed-out waits close the
        connection), polling elsewhere (reading the failure board meanwhile)."""
        if self.topology.device.type == "cpu":
            self._wait_blocking(work, what, step, deadline, group, where)
            return
        pause, next_check = 1e-5, time.monotonic() + CHECK_EVERY
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                reason = self.board.read() or step.abort.reason
                if reason is not None:
                    raise PipelineAborted(f"rank {self.rank} stopped waiting for {what} "
                                          f"because {reason}")
                next_check = now + CHECK_EVERY
            if now >= deadline:
                peers = sorted({op.peer for op in group.ops})
                ranks = self._ranks
                raise self.board.blame(PipelineTimeout(
                    f"rank {self.rank} (stage {self.topology.stage}) timed out after "
                    f"{step.timeout:g}s in {what}, with rank(s) "
                    f"{[ranks[p] for p in peers]}: raise timeout=... if stages are this slow",
                    rank=self.rank, **where), ranks[peers[0]])
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        try:
            work.wait()
        except RuntimeError as error:
            peer = self._ranks[group.ops[0].peer]
            raise self.board.lost(f"waiting for {what}", error, peer) from None

    def _wait_blocking(self, work: Any, what: str, step: StepState, deadline: float,
                       group: CommGroup, where: Dict[str, Any]) -> None:
        ranks = self._ranks
        peer = ranks[group.ops[0].peer]
        try:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as error:
            if "timed out" in str(error).lower() and self.board.read() is None:
                raise self.board.blame(PipelineTimeout(
                    f"rank {self.rank} (stage {self.topology.stage}) timed out after "
                    f"{step.timeout:g}s in {what}, with rank {peer}: raise timeout=... if stages "
                    f"are this slow", rank=self.rank, **where), peer) from error
            raise self.board.lost(f"waiting for {what}", error, peer) from None

    def _work(self, step: StepState, worker: int, group: List[int], rows: Rows,
              bell: threading.Condition) -> None:
        if self.exchange is None:
            return super()._work(step, worker, group, rows, bell)
        entries = iter(rows[group[0]])
        program = self._program
        posted: Optional[Posted] = None  # a group in flight (at most one: phases stay paired)
        with step.ambient():
            for op in program:
                if step.abort.reason is not None:
                    raise PipelineAborted(f"rank {self.rank} stopped because "
                                          f"{step.abort.reason}")
                if isinstance(op, CommGroup):
                    if self._learned is not None:
                        self._skip_learned(op)
                        continue
                    if posted is not None:  # its phases before any other group's
                        self._finish(step, posted, None)
                    self._doing(f"in the exchange {op}")
                    posted = self._post(step, op)
                    if not posted.receives:  # sends only: their second phase leaves now
                        self._finish(step, posted, None)
                        posted = None
                    continue
                action, route = next(entries)
                if posted is not None and posted.feeds(
                        (route.virtual_stage, action.kind, action.microbatch)):
                    self._finish(step, posted, action)
                    posted = None
                if action != op or not is_ready(step, route):
                    raise PipelineError(f"rank {self.rank} reached action {op} without its "
                                        f"messages: the program and the schedule disagree")
                self._run_action(step, worker, step.stages[route.virtual_stage], action)
            if posted is not None:
                self._finish(step, posted, None)
        if self.exchange.outgoing:  # a message its program never sent: refuse, never drop it
            left = sorted(map(str, self.exchange.outgoing))
            self.exchange.outgoing.clear()
            raise PipelineError(f"rank {self.rank} ended the step with unsent messages {left}: "
                                f"the program and the schedule disagree")
        return None

    def _skip_learned(self, group: CommGroup) -> None:
        learned, self._learned = self._learned, None
        if group != learned:
            raise PipelineError(f"rank {self.rank} learned the step's size from the exchange "
                                f"{learned}, but its program starts with {group}")

    # ---------------------------------------------------------------- one step
    def wire(self, step: StepState, schedule: Schedule) -> None:
        """Give every virtual stage a mailbox: local ones for this rank's stages, outboxes that
        send for the others'."""
        bell = threading.Condition()
        step.mailboxes = []
        for v in range(schedule.num_virtual_stages):
            if self.topology.local(v):
                step.mailboxes.append(Mailbox(bell))
            elif self.exchange is not None:
                step.mailboxes.append(Stash(v, self.exchange.outgoing))
            else:
                if v not in self._outboxes:
                    self._outboxes[v] = Outbox(v, self.topology.owner[v], self.transport,
                                               self.sends, self._sent_sizes)
                step.mailboxes.append(self._outboxes[v])
        step.abort.register(bell)
        self._bell = bell

    def _doing(self, what: str) -> None:
        """Tell the liveness record what this rank is doing in the current step."""
        liveness = self.board.liveness
        liveness.at(liveness.step, what)

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        """Run this rank's program; wait for its sends; every error names the rank. A failure
        caused by another rank (one that exited, froze or never started) is posted naming it."""
        try:
            with self.peers_named("running the step"):
                super().run(programs, step, schedule)
                self._flush_sends(step.timeout)
            self._doing("finished its actions")
        except PipelineError as error:
            culprit = getattr(error, "culprit", None)
            if culprit is None and isinstance(error, PipelineAborted):  # pass the first on
                culprit = self.board.read() or step.abort.reason
            self.fail(culprit or f"rank {self.topology.rank} (stage {self.topology.stage}) "
                                 f"failed: {error}")
            raise _with_rank(error, self.topology.rank) from error.__cause__

    def _check_programs(self, programs: Sequence[Sequence[Action]]) -> None:
        if self.topology.stage >= len(programs):
            raise ValueError(f"no program for stage {self.topology.stage}")

    def _wire(self, programs: Sequence[Sequence[Action]], step: StepState,
              schedule: Schedule) -> List[threading.Condition]:
        step.progress = [("not started" if s == self.topology.stage else "on another rank", None)
                         for s in range(len(programs))]
        step.busy = [0.0]
        return [self._bell]

    def _skip_links(self, step: StepState) -> Tuple[SkipLink, ...]:
        return self.skips

    watch_every = CHECK_EVERY

    def _failure_elsewhere(self) -> Optional[str]:
        return self.board.read()

    def _run_action(self, step: StepState, worker: int, stage: Any, action: Action) -> None:
        self._doing(f"running action {action} (micro-batch {action.microbatch})")
        super()._run_action(step, worker, stage, action)
        if self.after_action is not None:
            with stage.context():  # GPU: a gradient all-reduce ordered after the backward
                self.after_action(step, stage, action)

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
        other rank of the pipeline (any of them may be blocked on a message from this one)."""
        self.board.publish(reason)
        if self.topology.device.type != "cpu":  # NCCL pairs by order: the board alone tells
            return
        peers = self._ranks
        for peer in [r for r in peers if r != self.topology.rank]:
            try:
                send_failure(peer, self.topology.group, self.topology.device, reason,
                             self._notices)  # kept: a dropped send may never leave
            except Exception:  # noqa: BLE001 - a peer that is gone needs no notice
                pass

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
