"""Point-to-point messages between pipeline ranks over ``torch.distributed`` (gloo).

Messages go between ranks in one order per (sender, receiver) pair: the order in which the
sender's lowered stage program sends them (activations, gradients, and the tensors and gradients
of skip connections, for any of the receiver's stages). A message is keyed, on both ends, by the
receive op (``Comm``) of the receiver's program; its header carries what rebuilds that key.
The sending side is an :class:`Outbox`, which a stage's handlers see as the mailbox of a remote
stage: ``put`` ships the message with non-blocking sends. The receiving side is an
:class:`Inbox` per peer, which keeps the next receive posted ahead of the compute; the rank's
worker takes messages from it when an action needs them. Every wait has a timeout; a failing
rank sends its peers a failure notice in place of the next message.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ...schedule import Comm, CommKind, Payload, SkipLink
from ...schedule.lower import comm_from
from .device_copy import Parcel
from ..lowering import carries_loss
from .mailbox import Mailbox
from .message import BARE, TENSOR, Message
from .wire import (COUNT_DTYPE, HEADER_LEN, LOSS_DTYPES, Header, HostReads, Meta, layouts_of,
                   pack, unpack)

# fastpipe's tags, apart from a user's own small ones: headers, metadata, payloads. Each is a
# first-in first-out stream per pair of ranks (gloo matches receives to sends by tag, in order).
HEADER_TAG, META_TAG, PAYLOAD_TAG = 0x3F00, 0x3F01, 0x3F02
Channel = Tuple[Payload, Optional[SkipLink]]  # what travels, and on which skip connection


class TransportError(PipelineError):
    """Posting a send or a receive to ``peer`` failed in ``torch.distributed`` (its connection
    closed, say); the executor names the rank responsible from the liveness records."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


def _posted(call: Any, peer: int, what: str) -> Any:
    """``call()`` (a ``dist.isend``/``irecv``), its errors raised as ``TransportError``."""
    try:
        return call()
    except RuntimeError as error:
        raise TransportError(f"{what} with rank {peer} failed: {error}", peer) from error


class Channels:
    """The message channels of one pipe, numbered alike on every rank (a header's ``kind``):
    a stage's activations and gradients, then each skip connection's tensor and gradient, by
    name. A header's channel, micro-batch and stage, with the sending stage, rebuild the key."""

    def __init__(self, skips: Sequence[SkipLink] = ()) -> None:
        self.channels: List[Channel] = [(Payload.ACT, None), (Payload.GRAD, None)]
        for link in sorted(skips):
            self.channels += [(Payload.ACT, link), (Payload.GRAD, link)]
        self._index = {channel: i for i, channel in enumerate(self.channels)}

    def __len__(self) -> int:
        return len(self.channels)

    def index(self, key: Comm) -> int:
        """The channel number of a message's key."""
        return self._index[(key.what, key.skip)]

    def key(self, index: int, peer: int, microbatch: int, virtual_stage: int) -> Comm:
        """The key of a message on channel ``index`` from physical stage ``peer``."""
        what, skip = self.channels[index]
        return comm_from((CommKind.RECV, what, peer, microbatch, virtual_stage, skip))

    def name(self, index: int) -> str:
        """A channel's name in messages: ``act``, ``grad``, ``skip/<name>``,
        ``skipgrad/<name>``."""
        what, skip = self.channels[index]
        if skip is None:
            return str(what)
        return f"{'skip' if what is Payload.ACT else 'skipgrad'}/{skip.name}"


@dataclass
class PeerPayloads:
    """Byte counts of the last payload sent to (or received from) each peer rank.

    With ``prepost`` (gloo, which accepts a message shorter than the posted buffer), a receiver
    posts the next payload's receive together with its header's, sized like the peer's previous
    payload: a stream of same-sized micro-batches then costs one round trip per message, not
    two. A sender whose payload differs in size from its previous one first sends a one-byte
    filler that the pre-posted receive takes; the real payload follows in a fresh receive.
    """

    prepost: bool
    last: Dict[int, int] = field(default_factory=dict)

    def expected(self, peer: int) -> int:
        """The size of the receive that the peer has pre-posted (0: none)."""
        return self.last.get(peer, 0) if self.prepost else 0


FILLER = 1  # bytes of the filler that takes a pre-posted receive of the wrong size
ABORT_KIND = 255  # the header kind of a failure notice


@dataclass
class StepInfo:
    """Facts of the current step that headers carry: the micro-batch count and batch size
    (every header), and the micro-batch losses this rank knows (gradient headers)."""

    step: int = 0
    num_microbatches: int = 0
    batch_size: int = 0
    losses: Dict[int, Any] = field(default_factory=dict)  # micro-batch -> 0-dim tensor
    token_mean: Optional[Any] = None  # a token_mean.TokenMean: counts of (loss_sum, count)
    tags: Dict[int, int] = field(default_factory=dict)  # micro-batch -> weight version (PipeDream)

    def version(self, microbatch: int) -> int:
        """The weight version tag the first stage gave ``microbatch``, for its messages'
        headers (PipeDream's ``StepState.tags``; -1 when it has none)."""
        return self.tags.get(microbatch, -1)

    def tagged(self, header: Header) -> None:
        """Keep the weight version tag a received message's micro-batch carries, before any
        action uses the message."""
        if header.version >= 0:
            self.tags.setdefault(header.microbatch, header.version)

    def count(self, microbatch: int, reads: HostReads) -> float:
        """The micro-batch's count as a number, with ``(loss_sum, count)`` losses (a read on
        the host when it is a tensor; -1 without a count)."""
        value = self._count(microbatch)
        if isinstance(value, torch.Tensor):
            return reads.number(value)
        return -1.0 if value is None else float(value)

    def count_tensor(self, microbatch: int, device: torch.device) -> Optional[torch.Tensor]:
        """The micro-batch's count as one element on ``device``, read by nobody (``None``
        without a count)."""
        value = self._count(microbatch)
        if value is None:
            return None
        return torch.as_tensor(value, dtype=COUNT_DTYPE).reshape(1).to(device)

    def _count(self, microbatch: int) -> Any:
        counts = self.token_mean.counts if self.token_mean is not None else {}
        return counts.get(microbatch)

    def loss(self, microbatch: int, reads: HostReads) -> Tuple[Optional[float], torch.dtype]:
        """The micro-batch's loss as a number (a read on the host) and its dtype (``None`` when
        not known here; a NaN loss is known, and travels as NaN)."""
        value = self.losses.get(microbatch)
        if value is None:
            return None, torch.float32
        dtype = value.dtype if value.dtype in LOSS_DTYPES else torch.float32
        return reads.number(value), dtype

    def loss_tensor(self, microbatch: int, device: torch.device) -> Optional[torch.Tensor]:
        """The micro-batch's loss as one element on ``device`` in a dtype a header names, read
        by nobody (``None`` when not known here)."""
        value = self.losses.get(microbatch)
        if value is None:
            return None
        dtype = value.dtype if value.dtype in LOSS_DTYPES else torch.float32
        return value.detach().reshape(1).to(device, dtype)


@dataclass
class SendLog:
    """Sends in flight; their buffers stay referenced until the sends complete."""

    works: List[Tuple[Any, List[torch.Tensor], str]] = field(default_factory=list)

    def add(self, work: Any, tensors: List[torch.Tensor], what: str) -> None:
        self.works.append((work, tensors, what))


@dataclass
class Transport:
    """What both ends of this rank's messages share: the pipeline's process group, where
    buffers live, the numbering of message channels, and the facts of the current step."""

    group: Any
    device: torch.device
    rank: int  # this process's global rank
    channels: Channels
    info: StepInfo
    reads: HostReads = field(default_factory=HostReads)  # this step's reads of device buffers


class Outbox:
    """The mailbox of a stage held by another rank: ``put`` sends the message there."""

    def __init__(self, virtual_stage: int, rank: int, transport: Transport, log: SendLog,
                 payloads: PeerPayloads) -> None:
        self.virtual_stage = virtual_stage
        self.rank = rank  # the receiving rank
        self.transport = transport
        self.channels, self.info, self.device = (transport.channels, transport.info,
                                                 transport.device)
        self.log = log
        self.payloads = payloads
        self._sent_meta: Dict[int, Meta] = {}

    def put(self, key: Comm, message: Message) -> None:
        kind, mb = self.channels.index(key), key.microbatch
        tensors = message.parcel.tensors
        meta = to_meta(message, tensors)
        new_meta = self._sent_meta.get(kind) != meta
        meta_data = meta.encode().to(self.device) if new_meta else None
        payload = pack(tensors)
        loss, loss_dtype = (self.info.loss(mb, self.transport.reads) if carries_loss(key)
                            else (None, torch.float32))
        header = Header(kind, mb, self.virtual_stage,
                        self.info.num_microbatches, self.info.batch_size,
                        0 if meta_data is None else meta_data.numel(),
                        0 if payload is None else payload.numel() * payload.element_size(),
                        self.info.step, loss, loss_dtype,
                        self.info.count(mb, self.transport.reads) if carries_loss(key)
                        else -1.0, version=self.info.version(mb))
        what = (f"{self.channels.name(kind)} of micro-batch {mb} to stage {self.virtual_stage} "
                f"on rank {self.rank}")
        self._isend(header.encode().to(self.device), HEADER_TAG, what)
        if meta_data is not None:
            self._isend(meta_data, META_TAG, what)
        if self.payloads.expected(self.rank) not in (0, header.payload_nbytes):
            self._isend(torch.zeros(FILLER, dtype=torch.uint8, device=self.device), PAYLOAD_TAG,
                        what)
        if payload is not None and header.payload_nbytes:
            self._isend(payload, PAYLOAD_TAG, what)
        self.payloads.last[self.rank] = header.payload_nbytes
        if new_meta:
            self._sent_meta[kind] = meta

    def _isend(self, part: torch.Tensor, tag: int, what: str) -> None:
        work = _posted(lambda: dist.isend(part, self.rank, group=self.transport.group, tag=tag),
                       self.rank, f"sending the {what}")
        self.log.add(work, [part], what)

    def has(self, key: Any) -> bool:  # pragma: no cover - remote stages are never polled
        raise RuntimeError("an Outbox only sends; its stage runs on another rank")


class PeerFailed(RuntimeError):
    """The peer rank sent a failure notice instead of the message this rank waited for."""


class Inbox:
    """The messages one peer rank sends this rank in a step, received in the peer's send order
    by the thread that needs them, each dropped into the mailbox of the stage it is for (its
    header names it).

    The next header's receive (and, on gloo, its payload's) is always posted ahead, so the data
    lands while this rank computes, and a wait for it costs nothing when it is already there;
    there is no receiving thread to wake. The metadata cache lives across steps, as the
    sender's does.
    """

    def __init__(self, src_rank: int, src_stage: int, transport: Transport,
                 payloads: PeerPayloads) -> None:
        self.src_rank = src_rank
        self.src_stage = src_stage  # the peer's physical stage: the keys' peer
        self.transport = transport
        self.channels, self.info, self.device = (transport.channels, transport.info,
                                                 transport.device)
        self.payloads = payloads
        self.remaining: Optional[int] = 0  # messages still expected this step (None: unknown)
        self._meta: Dict[Tuple[int, int], Meta] = {}
        self._posted: Optional[Tuple[Any, torch.Tensor, Optional[Tuple[Any, torch.Tensor]]]] = None

    def begin(self, count: Optional[int]) -> None:
        """Expect ``count`` messages this step (``None``: until told by ``expect``); posts the
        first receive."""
        self.remaining = count
        self._posted = None
        if count is None or count > 0:
            self._post_next()

    def expect(self, count: int) -> None:
        """After the first message of a step begun with ``None``: ``count`` more follow."""
        self.remaining = count
        if count > 0 and self._posted is None:
            self._post_next()

    def receive_one(self, mailboxes: Sequence[Mailbox], timeout: float) -> Header:
        """Wait (at most ``timeout`` seconds per part) for the next message, put it in its
        stage's mailbox and post the receive of the one after; returns its header."""
        if self._posted is None:
            raise RuntimeError(f"no message from rank {self.src_rank} is expected this step")
        work, buffer, early = self._posted
        self._posted = None
        work.wait(datetime.timedelta(seconds=timeout))
        header = Header.decode(self.transport.reads.read(buffer))
        if header.kind == ABORT_KIND:
            raise PeerFailed(self._text(header, timeout))
        if not 0 <= header.kind < len(self.channels) or \
                not 0 <= header.dst_stage < len(mailboxes):
            raise ValueError(f"a message of kind {header.kind} for stage {header.dst_stage}: do "
                             f"all ranks build the same model (same skip connections, stages)?")
        key, message = self._message(header, early, timeout)
        self.info.tagged(header)
        if carries_loss(key) and header.loss is not None:
            self.info.losses.setdefault(header.microbatch,
                                        torch.tensor(header.loss, dtype=header.loss_dtype))
        if carries_loss(key) and header.count >= 0 and self.info.token_mean:
            self.info.token_mean.count(header.microbatch, header.count)  # before any backward
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining > 0:
                self._post_next()
        mailboxes[header.dst_stage].put(key, message)
        return header

    def _post_next(self) -> None:
        buffer = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        work = self._post(buffer, HEADER_TAG)
        early = None
        expected = self.payloads.expected(self.src_rank)
        if expected:
            payload = torch.empty(expected, dtype=torch.uint8, device=self.device)
            early = (self._post(payload, PAYLOAD_TAG), payload)
        self._posted = (work, buffer, early)

    def _post(self, buffer: torch.Tensor, tag: int) -> Any:
        return _posted(lambda: dist.irecv(buffer, self.src_rank, group=self.transport.group,
                                          tag=tag), self.src_rank, "posting a receive")

    def _recv(self, buffer: torch.Tensor, tag: int, timeout: float) -> None:
        self._post(buffer, tag).wait(datetime.timedelta(seconds=timeout))

    def _text(self, header: Header, timeout: float) -> str:
        data = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=self.device)
        self._recv(data, META_TAG, timeout)
        return self.transport.reads.read(data).numpy().tobytes().decode(errors="replace")

    def _message(self, header: Header, early: Optional[Tuple[Any, torch.Tensor]],
                 timeout: float) -> Tuple[Comm, Message]:
        where = (header.dst_stage, header.kind)
        if header.meta_nbytes:
            data = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=self.device)
            self._recv(data, META_TAG, timeout)
            self._meta[where] = Meta.decode(self.transport.reads.read(data), self.src_rank)
        meta = self._meta.get(where)
        if meta is None:
            raise ValueError("a message arrived without its metadata (the sender's cache and "
                             "this rank's disagree: were both pipes rebuilt together?)")
        n = header.payload_nbytes
        buffer = None
        if early is not None:  # the payload itself, or a filler when the size changed
            early[0].wait(datetime.timedelta(seconds=timeout))
            buffer = early[1] if early[1].numel() == n else None
        if buffer is None:
            buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
            if n:
                self._recv(buffer, PAYLOAD_TAG, timeout)
        self.payloads.last[self.src_rank] = n
        key = self.channels.key(header.kind, self.src_stage, header.microbatch, header.dst_stage)
        return key, from_meta(meta, unpack(buffer, meta.layouts))


def send_failure(rank: int, group: Any, device: torch.device, reason: str,
                 log: SendLog) -> None:
    """Tell a peer rank that this one failed: a header of kind ``ABORT_KIND`` and the reason,
    which the peer's next receive from this rank takes instead of the message it waited for."""
    text = torch.frombuffer(bytearray(reason.encode()[:4000] or b"?"), dtype=torch.uint8)
    header = Header(ABORT_KIND, -1, -1, 0, 0, text.numel(), 0, 0)
    for part, tag in ((header.encode(), HEADER_TAG), (text, META_TAG)):
        part = part.to(device)
        log.add(dist.isend(part, rank, group=group, tag=tag), [part], "failure notice")


def to_meta(message: Message, tensors: List[Optional[torch.Tensor]]) -> Meta:
    """The structure of a stage message, as data (the runtime's sentinels become flags)."""
    mask = [x is TENSOR for x in message.constants]
    constants = [None if is_tensor else x for x, is_tensor in zip(message.constants, mask)]
    spec = None if message.spec is BARE else message.spec
    return Meta(spec, constants, mask, list(message.requires_grad), layouts_of(tensors))


def from_meta(meta: Meta, tensors: List[Optional[torch.Tensor]]) -> Message:
    """The stage message a received ``meta`` and payload stand for."""
    constants = [TENSOR if is_tensor else x
                 for x, is_tensor in zip(meta.constants, meta.tensor_mask)]
    spec = BARE if meta.spec is None else meta.spec
    return Message(spec, constants, Parcel(tensors), list(meta.requires_grad))
