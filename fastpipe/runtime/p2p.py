"""Point-to-point messages between pipeline ranks over ``torch.distributed`` (gloo or NCCL).

Messages go between ranks in one order per (sender, receiver) pair: the order in which the
sender's stage program produces them (activations, gradients, and the tensors and gradients of
skip connections, for any of the receiver's stages). The sending side is an :class:`Outbox`,
which a stage's handlers see as the mailbox of a remote stage: ``put`` ships the message with
non-blocking sends. The receiving side is one :class:`LinkReceiver` thread per peer and step that
keeps a receive posted ahead of the compute that will need it and drops each arrived message into
the mailbox of the local stage its header names. Every wait has a timeout; a failure trips the
step's abort flag with the ranks involved.
"""
from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .hop import Parcel
from .mailbox import Abort, Mailbox
from .wire import HEADER_LEN, Header, Meta, layouts_of, pack, unpack

# fastpipe's tags, apart from a user's own small ones: headers, metadata, payloads. Each is a
# first-in first-out stream per pair of ranks (gloo matches by tag; NCCL ignores tags, and then
# the strict header, metadata, payload order of a message keeps the streams matched).
HEADER_TAG, META_TAG, PAYLOAD_TAG = 0x3F00, 0x3F01, 0x3F02
Key = Tuple[Any, ...]  # a mailbox key: ("act", mb), ("grad", mb), ("skip", name, mb), ...


class Kinds:
    """The message kinds of one pipe, numbered alike on every rank: activations, gradients, and
    for each skip connection (``fastpipe.skip``) its tensor and its gradient."""

    def __init__(self, skip_names: Sequence[str] = ()) -> None:
        self.names = ["act", "grad"]
        for name in sorted(skip_names):
            self.names += [f"skip/{name}", f"skipgrad/{name}"]

    def of(self, key: Key) -> str:
        """The kind of a mailbox key."""
        return key[0] if len(key) == 2 else f"{key[0]}/{key[1]}"

    def key(self, kind: str, microbatch: int) -> Key:
        """The mailbox key of a ``kind`` message of ``microbatch``."""
        if "/" in kind:
            head, name = kind.split("/", 1)
            return (head, name, microbatch)
        return (kind, microbatch)

    def index(self, kind: str) -> int:
        return self.names.index(kind)


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


@dataclass
class StepInfo:
    """Facts of the current step that every header repeats (micro-batch count, batch size)."""

    step: int = 0
    num_microbatches: int = 0
    batch_size: int = 0


@dataclass
class SendLog:
    """Sends in flight; their buffers stay referenced until the sends complete."""

    works: List[Tuple[Any, List[torch.Tensor], str]] = field(default_factory=list)

    def add(self, work: Any, tensors: List[torch.Tensor], what: str) -> None:
        self.works.append((work, tensors, what))


class Outbox:
    """The mailbox of a stage held by another rank: ``put`` sends the message there."""

    def __init__(self, virtual_stage: int, rank: int, group: Any, device: torch.device,
                 info: StepInfo, log: SendLog, kinds: Kinds, payloads: PeerPayloads) -> None:
        self.kinds = kinds
        self.payloads = payloads
        self.virtual_stage = virtual_stage
        self.rank = rank
        self.group = group
        self.device = device
        self.info = info
        self.log = log
        self._sent_meta: Dict[str, Meta] = {}

    def put(self, key: Key, message: Any) -> None:
        kind, mb = self.kinds.of(key), key[-1]
        tensors = message.parcel.tensors
        meta = to_meta(message, tensors)
        new_meta = self._sent_meta.get(kind) != meta
        meta_data = meta.encode().to(self.device) if new_meta else None
        payload = pack(tensors)
        header = Header(self.kinds.index(kind), mb, self.virtual_stage,
                        self.info.num_microbatches, self.info.batch_size,
                        0 if meta_data is None else meta_data.numel(),
                        0 if payload is None else payload.numel() * payload.element_size(),
                        self.info.step)
        what = f"{kind} of micro-batch {mb} to stage {self.virtual_stage} on rank {self.rank}"
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
        work = dist.isend(part, self.rank, group=self.group, tag=tag)
        self.log.add(work, [part], what)

    def has(self, key: Any) -> bool:  # pragma: no cover - remote stages are never polled
        raise RuntimeError("an Outbox only sends; its stage runs on another rank")


@dataclass
class Flow:
    """Messages of one kind into local virtual stage ``virtual_stage`` from stage ``src_stage``
    on rank ``src_rank``: ``count`` of them this step."""

    kind: str
    virtual_stage: int
    src_rank: int
    src_stage: int
    count: int


@dataclass
class Link:
    """Everything one peer rank sends to this rank in a step, in the order it sends it."""

    src_rank: int
    flows: List[Flow]

    @property
    def count(self) -> int:
        return sum(f.count for f in self.flows)

    def describe(self) -> str:
        return ", ".join(f"{f.kind} of stage {f.src_stage} -> {f.virtual_stage}"
                         for f in self.flows)


class LinkReceiver:
    """Receives, in order, the messages one peer rank sends this rank in a step, and drops each
    into the mailbox of the local stage it is for (the header names it).

    One receiver per peer keeps messages matched in the peer's send order, which is what both
    gloo and NCCL (which ignores tags) guarantee. It runs on a daemon thread (a blocked receive
    never keeps the process alive); its metadata cache lives across steps, as the sender's does.
    """

    def __init__(self, src_rank: int, group: Any, device: torch.device, rank: int,
                 kinds: Kinds, payloads: PeerPayloads) -> None:
        self.payloads = payloads
        self.src_rank = src_rank
        self.group = group
        self.device = device
        self.rank = rank
        self.kinds = kinds
        self.link = Link(src_rank, [])
        self._meta: Dict[Tuple[int, str], Meta] = {}
        self._thread: Optional[threading.Thread] = None

    def start(self, link: Link, mailboxes: Sequence[Mailbox], abort: Abort, timeout: float,
              on_header: Optional[Callable[[Header], None]] = None,
              explain: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Start receiving ``link.count`` messages (``on_header`` sees each header first and may
        extend ``link.flows``; ``explain`` gives the failure another rank posted, the likely
        cause of a lost peer)."""
        self.link = link
        self._thread = threading.Thread(
            target=self._loop, args=(mailboxes, abort, timeout, on_header, explain), daemon=True,
            name=f"fastpipe-recv-from-{self.src_rank}")
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait for the thread to finish; False if it is still blocked."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self, mailboxes: Sequence[Mailbox], abort: Abort, timeout: float,
              on_header: Optional[Callable[[Header], None]],
              explain: Optional[Callable[[], Optional[str]]]) -> None:
        received = 0
        try:
            while received < self.link.count:
                header, early = self._header(timeout, mailboxes)
                if on_header is not None:
                    on_header(header)
                key, message = self._message(header, early, timeout)
                mailboxes[header.dst_stage].put(key, message)
                received += 1
        except BaseException as error:  # noqa: BLE001 - reported through the step's abort flag
            cause = explain() if explain is not None else None
            if cause is not None:
                abort.trip(cause)
                return
            abort.trip(f"rank {self.rank} could not receive from rank {self.src_rank} "
                       f"({self.link.describe() or 'its messages'}); {received} of "
                       f"{self.link.count} arrived: {type(error).__name__}: {error}")

    def _post(self, buffer: torch.Tensor, tag: int) -> Any:
        return dist.irecv(buffer, self.src_rank, group=self.group, tag=tag)

    def _recv(self, buffer: torch.Tensor, tag: int, timeout: float) -> None:
        self._post(buffer, tag).wait(datetime.timedelta(seconds=timeout))

    def _header(self, timeout: float, mailboxes: Sequence[Mailbox]
                ) -> Tuple[Header, Optional[Tuple[Any, torch.Tensor]]]:
        """The next header, and the payload receive posted with it (sized like the last one)."""
        buffer = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        work = self._post(buffer, HEADER_TAG)
        early = None
        expected = self.payloads.expected(self.src_rank)
        if expected:
            payload = torch.empty(expected, dtype=torch.uint8, device=self.device)
            early = (self._post(payload, PAYLOAD_TAG), payload)
        work.wait(datetime.timedelta(seconds=timeout))
        header = Header.decode(buffer.cpu())
        if not 0 <= header.kind < len(self.kinds.names) or \
                not 0 <= header.dst_stage < len(mailboxes):
            raise ValueError(f"a message of kind {header.kind} for stage {header.dst_stage}: do "
                             f"all ranks build the same model (same skip connections, stages)?")
        return header, early

    def _message(self, header: Header, early: Optional[Tuple[Any, torch.Tensor]],
                 timeout: float) -> Tuple[Key, Any]:
        kind = self.kinds.names[header.kind]
        where = (header.dst_stage, kind)
        if header.meta_nbytes:
            data = torch.empty(header.meta_nbytes, dtype=torch.uint8, device=self.device)
            self._recv(data, META_TAG, timeout)
            self._meta[where] = Meta.decode(data.cpu())
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
        key = self.kinds.key(kind, header.microbatch)
        message = from_meta(meta, unpack(buffer, meta.layouts))
        if buffer.is_cuda:  # the stage's stream waits for the receive (``hop.land``)
            message.parcel.event = torch.cuda.Event()
            message.parcel.event.record()
        return key, message


def to_meta(message: Any, tensors: List[Optional[torch.Tensor]]) -> Meta:
    """The picklable structure of a stage message (the runtime's sentinels become flags)."""
    from . import step
    mask = [x is step._TENSOR for x in message.constants]
    constants = [None if is_tensor else x for x, is_tensor in zip(message.constants, mask)]
    spec = None if message.spec is step._BARE else message.spec
    return Meta(spec, constants, mask, list(message.requires_grad), layouts_of(tensors))


def from_meta(meta: Meta, tensors: List[Optional[torch.Tensor]]) -> Any:
    """The stage message a received ``meta`` and payload stand for."""
    from . import step
    constants = [step._TENSOR if is_tensor else x
                 for x, is_tensor in zip(meta.constants, meta.tensor_mask)]
    spec = step._BARE if meta.spec is None else meta.spec
    return step.Message(spec, constants, Parcel(tensors), list(meta.requires_grad))
