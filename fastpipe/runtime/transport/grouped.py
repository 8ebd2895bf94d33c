"""The grouped transport: a rank's messages move in the groups of its NCCL program.

With ``DistributedPipe(p2p="grouped")`` (the default on NCCL) a rank runs the program of
:func:`fastpipe.schedule.lower_nccl`: compute actions, and between them communication groups
posted with ``torch.distributed.batch_isend_irecv``. A message an action produces for another
rank waits in this rank's :class:`Stash` until the program reaches the group of its round,
then leaves with it. A message has two channels:

- the side channel (gloo, CPU tensors; the pipeline's own group when it has gloo for the CPU,
  else a gloo group of the same ranks): the fixed-size header, and the metadata when it
  changed. The host writes and reads them without touching the GPU, so a rank's host never
  waits for its device to learn what arrives: it runs ahead and keeps the GPU's queue full.
  A failing rank's notice comes in a header's place, on GPUs too;
- the data channel (the device's backend: NCCL, or gloo on the CPU): the payload, and the
  micro-batch's loss as a tensor of its own (``Header.attached``; with ``(loss_sum, count)``
  losses its count too, ``Header.count_attached``), so neither has to be read on the host to
  travel.

Every data receive is sized exactly (NCCL needs equal sizes on both ends), in two phases:

- phase 1 of a group: every part whose size is the one the same message (sender, channel,
  stage, micro-batch) had last time; both ends keep that table, so a steady stream of steps
  needs one group per round;
- phase 2, only when a header says so: the parts whose size changed (phase 1 then carried a
  filler of the old size).

Both ends decide phase 2 from the same headers, so the data ops between each pair of ranks are
posted in the same order on both, as NCCL pairs them (the groups of the NCCL program, which
:mod:`fastpipe.schedule.nccl` proves deadlock-free). The host waits only for headers and
metadata (bounded); on a GPU, a data receive is waited for by the streams that use it
(``work.wait()``: no host synchronisation), on gloo by the host (bounded). Buffers the
transport would read on the host go through :class:`~.wire.HostReads`: in this transport none
does, on any step (none of ``pipe.last_step.host_reads`` is this transport's). Sends are never waited for before the
step's end, as on NCCL, where the CPU only enqueues them.
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
from ...streams.exchange import ExchangeStreams
from ..lowering import carries_loss
from .mailbox import Mailbox
from .message import Message
from .p2p import (ABORT_KIND, HEADER_TAG, META_TAG, PAYLOAD_TAG, PeerFailed, SendLog, Transport,
    TransportError, from_meta, to_meta)
from .wire import HEADER_LEN, Header, Meta, attach, detach_attached, pack, unpack

SizeKey = Tuple[int, int, int, int]  # (sending stage, channel, receiving stage, micro-batch)
Sizes = Tuple[int, int]  # bytes of a message's data parts: the payload, the attached loss
NONE: Sizes = (0, 0)
Wait = Callable[[Any, str], None]  # a bounded host wait for a work, its error naming ``what``
Op = Tuple[Any, torch.Tensor, int, int]  # (dist.isend or dist.irecv, tensor, rank, tag)
Launched = List[Tuple[str, Any, List[torch.Tensor]]]  # (role, work, tensors)


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
    """One message of a group being sent: its header and metadata (CPU), its data parts."""

    rank: int
    header: Header
    meta: Optional[torch.Tensor]  # the metadata's bytes when it changed (else None)
    parts: Tuple[Optional[torch.Tensor], ...]  # payload, loss (bytes on the device; or None)
    cached: Sizes  # what phase 1 carries

    @property
    def sizes(self) -> Sizes:
        return _sizes(self.parts)


@dataclass
class _Incoming:
    """One message of a group being received: its header's buffer, then its data parts."""

    op: Comm
    rank: int
    header: torch.Tensor  # on the CPU (side channel)
    cached: Sizes
    first: List[Optional[torch.Tensor]]  # phase 1's buffers (None: none posted)
    work: Any = None  # the header's receive
    parts: List[Optional[torch.Tensor]] = field(default_factory=lambda: [None, None])


def _sizes(parts: Sequence[Optional[torch.Tensor]]) -> Sizes:
    payload, loss = (0 if p is None else p.numel() for p in parts)
    return payload, loss


@dataclass
class GroupedExchange:
    """Runs the communication groups of this rank's NCCL program (see module docstring)."""

    transport: Transport
    side: Any  # the side channel: a gloo group of the pipeline's ranks (CPU tensors)
    stage: int  # this rank's physical stage
    ranks: Sequence[int]  # the global rank of every physical stage
    log: SendLog
    outgoing: Dict[Comm, Message] = field(default_factory=dict)
    sizes: Dict[SizeKey, Sizes] = field(default_factory=dict)  # last data sizes, both ends
    _meta_sent: Dict[Tuple[int, int], Meta] = field(default_factory=dict)  # (stage, channel)
    _meta_seen: Dict[Tuple[int, int], Meta] = field(default_factory=dict)
    streams: Optional[ExchangeStreams] = None  # the communication stream (default: device's)

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = ExchangeStreams(self.transport.device)

    def run(self, group: CommGroup, mailboxes: Sequence[Mailbox], wait: Wait) -> List[Header]:
        """Send and receive every message of ``group``; received ones go into their stage's
        mailbox. Returns the received headers."""
        return self.finish(self.post(group), mailboxes, wait)

    def post(self, group: CommGroup) -> "Posted":
        """Post phase 1 of ``group`` without waiting: headers (and changed metadata) on the
        side channel, the data parts of cached sizes on the data channel (on a GPU: on the
        communication stream, after the local stages' work, :mod:`fastpipe.streams.exchange`)."""
        with self.streams.posting():
            return self._post(group)

    def _post(self, group: CommGroup) -> "Posted":
        sends = [self._outgoing(op) for op in group.ops if op.kind is CommKind.SEND]
        receives = [self._incoming(op) for op in group.ops if op.kind is CommKind.RECV]
        for inc in receives:
            inc.work = self._side(dist.irecv, inc.header, inc.rank, HEADER_TAG, group)
        for out in sends:
            self._announce(out, group)
        first: List[Op] = []
        for out in sends:
            first += [(dist.isend, self._phase1_part(out, i), out.rank, PAYLOAD_TAG)
                      for i, size in enumerate(out.cached) if size]
        for inc in receives:
            first += [(dist.irecv, buffer, inc.rank, PAYLOAD_TAG) for buffer in inc.first
                      if buffer is not None]
        return Posted(group, sends, receives, self._launch(first, group))

    def finish(self, posted: "Posted", mailboxes: Sequence[Mailbox],
               wait: Wait) -> List[Header]:
        """Read a posted group's headers (the host waits for them, bounded: a failure notice
        comes in a header's place), wait for its phase 1, run its phase 2 if a header asks
        for one, and deliver what it received; returns the received headers. On a GPU the
        local stages' streams then wait for the communication stream."""
        with self.streams.finishing():
            return self._finish(posted, mailboxes, wait)

    def _finish(self, posted: "Posted", mailboxes: Sequence[Mailbox],
                wait: Wait) -> List[Header]:
        group, sends, receives = posted.group, posted.sends, posted.receives
        headers = [self._read_header(inc, wait, group) for inc in receives]
        self._await(posted.launched, wait, group)
        second: List[Op] = []
        for out in sends:
            second += [(dist.isend, part, out.rank, PAYLOAD_TAG)
                       for part, size, cached in zip(out.parts, out.sizes, out.cached)
                       if part is not None and size != cached]
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
        meta_data = meta.encode() if self._meta_sent.get(where) != meta else None
        self._meta_sent[where] = meta
        loss = info.loss_tensor(mb, self.transport.device) if carries_loss(key) else None
        count = info.count_tensor(mb, self.transport.device) if loss is not None else None
        parts = (_as_bytes(pack(tensors, self.streams.backend)),
                 None if loss is None else attach(loss, count))
        self.streams.read([*tensors, loss, count])  # read by the pack: not reused before
        header = Header(kind, mb, key.virtual_stage, info.num_microbatches, info.batch_size,
                        0 if meta_data is None else meta_data.numel(), _sizes(parts)[0],
                        info.step, None, torch.float32 if loss is None else loss.dtype,
                        attached=loss is not None, count_attached=count is not None,
                        version=info.version(mb))
        size_key = (self.stage, kind, key.virtual_stage, mb)
        cached = self.sizes.get(size_key, NONE)
        self.sizes[size_key] = _sizes(parts)
        return _Outgoing(self.ranks[op.peer], header, meta_data, parts, cached)

    def _announce(self, out: _Outgoing, group: CommGroup) -> None:
        """Send a message's header, and its metadata when it changed, on the side channel."""
        parts = [out.header.encode()] + ([] if out.meta is None else [out.meta])
        for part, tag in zip(parts, (HEADER_TAG, META_TAG)):
            self.log.add(self._side(dist.isend, part, out.rank, tag, group), [part],
                         f"the exchange {group}")

    def _phase1_part(self, out: _Outgoing, index: int) -> torch.Tensor:
        """A data part when its size is the cached one, else a filler of the cached size."""
        part = out.parts[index]
        if part is not None and part.numel() == out.cached[index]:
            return part
        return self.streams.filler(out.cached[index])

    # ---------------------------------------------------------------- receiving
    def _incoming(self, op: Comm) -> _Incoming:
        kind = self.transport.channels.index(op)
        cached = self.sizes.get((op.peer, kind, op.virtual_stage, op.microbatch), NONE)
        first = [self.streams.buffer(n) if n else None for n in cached]
        return _Incoming(op, self.ranks[op.peer], torch.empty(HEADER_LEN, dtype=torch.int64),
                         cached, first)

    def _read_header(self, inc: _Incoming, wait: Wait, group: CommGroup) -> Header:
        """A message's header, and its metadata when it changed (side channel, CPU tensors:
        no device read); a failure notice in the header's place raises ``PeerFailed``."""
        wait(inc.work, f"the exchange {group}")
        header = Header.decode(inc.header)
        if header.kind == ABORT_KIND:
            raise PeerFailed(self._notice(inc, header, wait))
        op, channels = inc.op, self.transport.channels
        expected = (channels.index(op), op.microbatch, op.virtual_stage)
        if (header.kind, header.microbatch, header.dst_stage) != expected:
            raise PipelineError(
                f"stage {self.stage} expected '{op}' from rank {inc.rank} but received "
                f"{channels.name(header.kind) if 0 <= header.kind < len(channels) else '?'} of "
                f"micro-batch {header.microbatch} for stage {header.dst_stage}: do all ranks run "
                f"the same schedule, chunks and model?")
        if header.meta_nbytes:
            data = torch.empty(header.meta_nbytes, dtype=torch.uint8)
            wait(self._side(dist.irecv, data, inc.rank, META_TAG, group),
                 f"the metadata of '{op}' in the exchange {group}")
            self._meta_seen[(header.dst_stage, header.kind)] = Meta.decode(data, inc.rank)
        return header

    def _notice(self, inc: _Incoming, header: Header, wait: Wait) -> str:
        """The text of a failure notice (side channel, after its header)."""
        text = torch.empty(header.meta_nbytes, dtype=torch.uint8)
        wait(self._side(dist.irecv, text, inc.rank, META_TAG, None),
             f"the failure notice of rank {inc.rank}")
        return text.numpy().tobytes().decode(errors="replace")

    def _phase2_receives(self, inc: _Incoming, header: Header) -> List[Op]:
        """The receives of the parts whose size changed (and the size table updated)."""
        sizes = (header.payload_nbytes, header.loss_nbytes)
        self.sizes[(inc.op.peer, header.kind, header.dst_stage, header.microbatch)] = sizes
        ops: List[Op] = []
        for i, (size, cached) in enumerate(zip(sizes, inc.cached)):
            if size == cached:
                inc.parts[i] = inc.first[i]
            elif size:
                inc.parts[i] = self.streams.buffer(size)
                ops.append((dist.irecv, inc.parts[i], inc.rank, PAYLOAD_TAG))
        return ops

    def _deliver(self, inc: _Incoming, header: Header, mailboxes: Sequence[Mailbox]) -> None:
        meta = self._meta_seen.get((header.dst_stage, header.kind))
        if meta is None:
            raise PipelineError("a message arrived without its metadata (the sender's cache and "
                                "this rank's disagree: were both pipes rebuilt together?)")
        info = self.transport.info
        info.tagged(header)  # PipeDream's weight version of the micro-batch
        payload, loss = inc.parts
        self.streams.hand_over((payload, loss))  # the stages' streams use them
        if carries_loss(inc.op) and loss is not None:  # stays on the device: never read here
            value, count = detach_attached(header, loss)
            info.losses.setdefault(header.microbatch, value)
            if count is not None and info.token_mean is not None:
                info.token_mean.count(header.microbatch, count)  # before any backward
        buffer = payload if payload is not None else torch.empty(
            0, dtype=torch.uint8, device=self.transport.device)
        mailboxes[header.dst_stage].put(inc.op, from_meta(meta, unpack(buffer, meta.layouts)))

    # ---------------------------------------------------------------- posting
    def _side(self, op: Any, tensor: torch.Tensor, rank: int, tag: int,
              group: Optional[CommGroup]) -> Any:
        """``op`` (``dist.isend`` or ``dist.irecv``) of a CPU tensor on the side channel."""
        try:
            return op(tensor, rank, group=self.side, tag=tag)
        except RuntimeError as error:
            raise TransportError(f"the side channel of the exchange {group} with rank {rank} "
                                 f"failed: {error}", rank) from error

    def _launch(self, ops: List[Op], group: CommGroup) -> Launched:
        """One ``batch_isend_irecv`` of ``ops`` on the data channel: its works, each with its
        role (``'send'``, ``'data'`` received, or ``'group'``: NCCL gives one work for the
        whole group) and its tensors (a send is only waited for at the step's end, its tensor
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
        return [("send" if op is dist.isend else "data", work, [tensor])
                for (op, tensor, _, _), work in zip(ops, works)]

    def _await(self, launched: Launched, wait: Wait, group: CommGroup) -> None:
        """Receives done before what follows: on a GPU the communication stream waits for
        them (``work.wait()``, the stages' streams after it: the host goes on), elsewhere the
        host (bounded). Sends are logged, waited for at the step's end."""
        what = f"the exchange {group}"
        for role, work, tensors in launched:
            if role == "send":
                self.log.add(work, tensors, what)
                continue
            if self.transport.device.type == "cuda":
                try:
                    work.wait()
                except RuntimeError as error:
                    raise TransportError(f"{what} failed: {error}", -1) from error
            else:
                wait(work, what)
            self.log.add(None, tensors, what)


def _as_bytes(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A data part: the tensor's bytes (``None``: nothing to send)."""
    if tensor is None or tensor.numel() == 0:
        return None
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Posted:
    """A group whose phase 1 is in flight."""

    group: CommGroup
    sends: List[_Outgoing]
    receives: List[_Incoming]
    launched: Launched

    def feeds(self, consumer: Tuple[int, Any, int]) -> bool:
        """Whether the group receives a tensor for the action ``(virtual stage, kind,
        micro-batch)``."""
        return any(consumer == consumer_of(comm_fields(inc.op)) for inc in self.receives)
