"""The grouped transport: a rank's messages move in the groups of its NCCL program.

With ``DistributedPipe(p2p="grouped")`` (the default on NCCL) a rank runs the program of
:func:`fastpipe.schedule.lower_nccl`: compute actions, and between them communication groups
posted with ``torch.distributed.batch_isend_irecv``. A message an action produces for another
rank waits in this rank's :class:`Stash` until the program reaches the group of its round,
then leaves with it. Every receive is sized exactly (NCCL needs equal sizes on both ends):

- phase 1 of a group: every message's fixed-size header, and its payload when its size is the
  one the same message (sender, channel, stage, micro-batch) had last time; both ends keep that
  table, so a steady stream of steps needs one group per round;
- phase 2, only when a header says so: the metadata of a message whose structure changed, and
  the payload of one whose size changed (phase 1 then carried a filler of the old size).

Both ends decide phase 2 from the same headers, so the ops between each pair of ranks are
posted in the same order on both, as NCCL pairs them. On gloo the same groups run (the CI runs
this code path without a GPU); sends are never waited for before the step's end, as on NCCL,
where the CPU only enqueues them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ...schedule import Comm, CommGroup, CommKind
from ...schedule.lower import comm_fields
from ...schedule.nccl_model import consumer_of
from ..lowering import carries_loss
from .mailbox import Mailbox
from .message import Message
from .p2p import (ABORT_KIND, HEADER_TAG, META_TAG, PAYLOAD_TAG, PeerFailed, SendLog, Transport,
    TransportError, from_meta, to_meta)
from .wire import HEADER_LEN, Header, Meta, pack, unpack

SizeKey = Tuple[int, int, int, int]  # (sending stage, channel, receiving stage, micro-batch)
Wait = Callable[[Any, str], None]  # waits for a work, raising an error that names ``what``


class Stash:
    """The mailbox of a stage another rank holds, in grouped mode: ``put`` keeps the message
    (keyed by its receive op) until this rank's program reaches the group that sends it."""

    def __init__(self, virtual_stage: int, outgoing: Dict[Comm, Message]) -> None:
        self.virtual_stage = virtual_stage
        self.outgoing = outgoing

    def put(self, key: Comm, message: Message) -> None:
        self.outgoing[key] = message

    def has(self, key: Any) -> bool:  # pragma: no cover - remote stages are never polled
        raise RuntimeError("a Stash only sends; its stage runs on another rank")


@dataclass
class _Outgoing:
    """One message of a group being sent: its parts, and what phase 2 carries."""

    rank: int
    header: Header
    meta: Optional[torch.Tensor]
    payload: Optional[torch.Tensor]
    cached: int  # bytes phase 1 carried (0: none)


@dataclass
class _Incoming:
    """One message of a group being received: its buffers, filled phase by phase."""

    op: Comm
    rank: int
    header: torch.Tensor
    cached: Optional[torch.Tensor]  # phase 1's payload buffer (None: none posted)
    meta: Optional[torch.Tensor] = None
    payload: Optional[torch.Tensor] = None


@dataclass
class GroupedExchange:
    """Runs the communication groups of this rank's NCCL program (see module docstring)."""

    transport: Transport
    stage: int  # this rank's physical stage
    ranks: Sequence[int]  # the global rank of every physical stage
    log: SendLog
    outgoing: Dict[Comm, Message] = field(default_factory=dict)
    sizes: Dict[SizeKey, int] = field(default_factory=dict)  # last payload bytes, both ends
    _meta_sent: Dict[Tuple[int, int], Meta] = field(default_factory=dict)  # (stage, channel)
    _meta_seen: Dict[Tuple[int, int], Meta] = field(default_factory=dict)
    consumer_streams: List[Any] = field(default_factory=list)  # CUDA: the local stages' streams

    def run(self, group: CommGroup, mailboxes: Sequence[Mailbox], wait: Wait) -> List[Header]:
        """Send and receive every message of ``group``; received ones go into their stage's
        mailbox. Returns the received headers."""
        return self.finish(self.post(group), mailboxes, wait)

    def post(self, group: CommGroup) -> "Posted":
        """Post phase 1 of ``group`` (headers, and payloads of cached sizes) without waiting."""
        sends = [self._outgoing(op) for op in group.ops if op.kind is CommKind.SEND]
        receives = [self._incoming(op) for op in group.ops if op.kind is CommKind.RECV]
        first: List[Tuple[Any, torch.Tensor, int, int]] = []  # (op, tensor, rank, tag)
        for out in sends:
            first.append((dist.isend, out.header.encode().to(self.transport.device), out.rank,
                          HEADER_TAG))
            if out.cached:
                first.append((dist.isend, self._phase1_payload(out), out.rank, PAYLOAD_TAG))
        for inc in receives:
            first.append((dist.irecv, inc.header, inc.rank, HEADER_TAG))
            if inc.cached is not None:
                first.append((dist.irecv, inc.cached, inc.rank, PAYLOAD_TAG))
        return Posted(group, sends, receives, self._launch(first, group))

    def finish(self, posted: "Posted", mailboxes: Sequence[Mailbox],
               wait: Wait) -> List[Header]:
        """Wait for phase 1 of a posted group, run its phase 2 if a header asks for one, and
        deliver what it received; returns the received headers."""
        group, sends, receives = posted.group, posted.sends, posted.receives
        headers_first = sorted(posted.launched, key=lambda item: item[0] != "header")
        waited = 0
        for item in headers_first:  # a failure notice comes in a header's place: stop there
            if item[0] != "header":
                break
            self._await([item], wait, group)
            waited += 1
        headers = [self._read_header(inc) for inc in receives]
        self._await(headers_first[waited:], wait, group)
        second: List[Tuple[Any, torch.Tensor, int, int]] = []
        for out in sends:
            if out.meta is not None:
                second.append((dist.isend, out.meta, out.rank, META_TAG))
            if out.payload is not None and out.header.payload_nbytes != out.cached:
                second.append((dist.isend, out.payload, out.rank, PAYLOAD_TAG))
        for inc, header in zip(receives, headers):
            second += self._phase2_receives(inc, header)
        if second:
            self._await(self._launch(second, group), wait, group)
        for inc, header in zip(receives, headers):
            self._deliver(inc, header, mailboxes)
        return headers

    # ---------------------------------------------------------------- sending
    def _outgoing(self, op: Comm) -> _Outgoing:
        key = op.counterpart(self.stage)
        message = self.outgoing.pop(key, None)
        if message is None:
            raise PipelineError(f"the program of stage {self.stage} sends '{op}' before the "
                                f"action that produces it ran")
        info, channels = self.transport.info, self.transport.channels
        kind, mb = channels.index(key), key.microbatch
        tensors = message.parcel.tensors
        meta = to_meta(message, tensors)
        where = (key.virtual_stage, kind)
        meta_data = meta.encode().to(self.transport.device) \
            if self._meta_sent.get(where) != meta else None
        self._meta_sent[where] = meta
        payload = pack(tensors)
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        loss, loss_dtype = info.loss(mb) if carries_loss(key) else (None, torch.float32)
        header = Header(kind, mb, key.virtual_stage, info.num_microbatches, info.batch_size,
                        0 if meta_data is None else meta_data.numel(), nbytes, info.step,
                        loss, loss_dtype, info.count(mb) if carries_loss(key) else -1.0)
        size_key = (self.stage, kind, key.virtual_stage, mb)
        cached = self.sizes.get(size_key, 0)
        self.sizes[size_key] = nbytes
        return _Outgoing(self.ranks[op.peer], header, meta_data, payload if nbytes else None,
                         cached)

    def _phase1_payload(self, out: _Outgoing) -> torch.Tensor:
        """The payload when its size is the cached one, else a filler of the cached size."""
        if out.payload is not None and out.header.payload_nbytes == out.cached:
            return out.payload
        return torch.zeros(out.cached, dtype=torch.uint8, device=self.transport.device)

    # ---------------------------------------------------------------- receiving
    def _incoming(self, op: Comm) -> _Incoming:
        device = self.transport.device
        kind = self.transport.channels.index(op)
        cached = self.sizes.get((op.peer, kind, op.virtual_stage, op.microbatch), 0)
        return _Incoming(op, self.ranks[op.peer],
                         torch.empty(HEADER_LEN, dtype=torch.int64, device=device),
                         torch.empty(cached, dtype=torch.uint8, device=device) if cached else None)

    def _read_header(self, inc: _Incoming) -> Header:
        header = Header.decode(inc.header.cpu())
        if header.kind == ABORT_KIND:
            raise PeerFailed(self._notice(inc, header))
        op, channels = inc.op, self.transport.channels
        expected = (channels.index(op), op.microbatch, op.virtual_stage)
        if (header.kind, header.microbatch, header.dst_stage) != expected:
            raise PipelineError(
                f"stage {self.stage} expected '{op}' from rank {inc.rank} but received "
                f"{channels.name(header.kind) if 0 <= header.kind < len(channels) else '?'} of "
                f"micro-batch {header.microbatch} for stage {header.dst_stage}: do all ranks run "
                f"the same schedule, chunks and model?")
        return header

    def _notice(self, inc: _Incoming, header: Header) -> str:
        """The text of a failure notice (gloo: its own tag, so it does not disturb phases)."""
        text = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=self.transport.device)
        dist.irecv(text, inc.rank, group=self.transport.group, tag=META_TAG).wait()
        return text.cpu().numpy().tobytes().decode(errors="replace")

    def _phase2_receives(self, inc: _Incoming,
                         header: Header) -> List[Tuple[Any, torch.Tensor, int, int]]:
        device, ops = self.transport.device, []
        size_key = (inc.op.peer, header.kind, header.dst_stage, header.microbatch)
        cached = 0 if inc.cached is None else inc.cached.numel()
        self.sizes[size_key] = header.payload_nbytes
        if header.meta_nbytes:
            inc.meta = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=device)
            ops.append((dist.irecv, inc.meta, inc.rank, META_TAG))
        if header.payload_nbytes == cached:
            inc.payload = inc.cached
        elif header.payload_nbytes:
            inc.payload = torch.empty(header.payload_nbytes, dtype=torch.uint8, device=device)
            ops.append((dist.irecv, inc.payload, inc.rank, PAYLOAD_TAG))
        return ops

    def _deliver(self, inc: _Incoming, header: Header, mailboxes: Sequence[Mailbox]) -> None:
        where = (header.dst_stage, header.kind)
        if inc.meta is not None:
            self._meta_seen[where] = Meta.decode(inc.meta.cpu())
        meta = self._meta_seen.get(where)
        if meta is None:
            raise PipelineError("a message arrived without its metadata (the sender's cache and "
                                "this rank's disagree: were both pipes rebuilt together?)")
        info = self.transport.info
        if carries_loss(inc.op) and header.loss is not None:
            info.losses.setdefault(header.microbatch,
                                   torch.tensor(header.loss, dtype=header.loss_dtype))
        if carries_loss(inc.op) and header.count >= 0 and info.token_mean:
            info.token_mean.count(header.microbatch, header.count)  # before any backward
        buffer = inc.payload if inc.payload is not None else torch.empty(
            0, dtype=torch.uint8, device=self.transport.device)
        for stream in self.consumer_streams:  # allocated on the communication stream, read
            buffer.record_stream(stream)       # on the stages': the allocator must know
        mailboxes[header.dst_stage].put(inc.op, from_meta(meta, unpack(buffer, meta.layouts)))

    # ---------------------------------------------------------------- posting
    def _launch(self, ops: List[Tuple[Any, torch.Tensor, int, int]],
                group: CommGroup) -> List[Tuple[Any, Any, List[torch.Tensor]]]:
        """One ``batch_isend_irecv`` of ``ops``: its works, each with its role (``'send'``,
        ``'header'`` or ``'data'`` received, or ``'group'``: NCCL gives one work for the whole
        group) and its tensors (a send is only waited for at the step's end, its tensor
        referenced until then)."""
        if not ops:
            return []
        pg = self.transport.group
        p2p = [dist.P2POp(op, tensor, peer=rank, group=pg, tag=tag)
               for op, tensor, rank, tag in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as error:
            peer = next((rank for _, _, rank, _ in ops), -1)
            raise TransportError(f"posting the exchange {group} failed: {error}", peer) from error
        if len(works) != len(ops):  # coalesced (NCCL)
            return [("group", work, [tensor for _, tensor, _, _ in ops]) for work in works]
        return [("send" if op is dist.isend else "header" if tag == HEADER_TAG else "data",
                 work, [tensor]) for (op, tensor, _, tag), work in zip(ops, works)]

    def _await(self, launched: List[Tuple[Any, Any, List[torch.Tensor]]], wait: Wait,
               group: CommGroup) -> None:
        what = f"the exchange {group}"
        for role, work, tensors in launched:
            if role == "send":
                self.log.add(work, tensors, what)
            else:
                wait(work, what)
                self.log.add(None, tensors, what)


@dataclass
class Posted:
    """A group whose phase 1 is in flight."""

    group: CommGroup
    sends: List[_Outgoing]
    receives: List[_Incoming]
    launched: List[Tuple[Any, Any, List[torch.Tensor]]]

    def feeds(self, consumer: Tuple[int, Any, int]) -> bool:
        """Whether the group receives a tensor for the action ``(virtual stage, kind,
        micro-batch)``."""
        return any(consumer == consumer_of(comm_fields(inc.op)) for inc in self.receives)

