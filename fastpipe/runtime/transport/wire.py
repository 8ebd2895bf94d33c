"""The wire format of messages between pipeline ranks: a fixed header, cached metadata, payload.

Every message (an activation or a gradient of one micro-batch) travels as:

1. a header of ``HEADER_LEN`` int64 values: what the message is (kind, micro-batch, the
   receiving stage), the step's micro-batch count and batch size, the byte counts of what
   follows, and (for gradients) the micro-batch's loss, so every rank learns the step's loss
   from the gradients it receives, without a collective (the grouped transport sends the loss
   tensor itself next to the payload, ``attached``, and with ``(loss_sum, count)`` losses the
   micro-batch's count before it, ``count_attached``: neither value has to reach the host),
   and, under PipeDream, the tag of its weight version (``version``: how many updates the first
   stage had applied in the call when it forwarded the micro-batch; vertical sync and tied
   weights use it on every stage);
2. the metadata (tensor dtypes and shapes, the pytree structure, non-tensor leaves) as JSON
   data (decoding it runs nothing: :mod:`.data_codec`), only when it differs from the
   previous message of the same kind to the same stage: the receiver caches it, so a stream
   of same-shaped micro-batches sends it once, and a new sequence length costs one small
   extra message, never padding;
3. the payload, as bytes: the single tensor's own memory, or several tensors packed into one
   byte buffer (one transfer instead of many).

Pure functions on tensors and bytes, no communication: tested without processes. The step
(its transport, its gradients' close) reads a buffer of its device on the host only through
:class:`HostReads`, which counts the reads (``pipe.last_step.host_reads``).
"""
from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ...errors import ProtocolError
from ...streams.backend import HOST, StreamBackend
from . import data_codec as codec

MAGIC = 0x66_70_70_31  # "fpp1"
HEADER_LEN = 13
# The dtypes a loss may have, by the code a header carries (the loss comes back in its own dtype).
LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NO_LOSS = 255  # the loss dtype code of a header that carries no loss (any loss, NaN included,
# travels with its own dtype code: a NaN loss is a loss, never "unknown")
ATTACHED = 64  # added to the loss dtype code: the loss travels as its own part, not in the header
COUNTED = 128  # added too when the attached part starts with the micro-batch's count
COUNT_DTYPE = torch.float64  # a count in an attached part (whole numbers: exact below 2**53)
ALIGN = 16  # bytes: every packed tensor starts at a multiple (any dtype can view it)
FORMAT = 1  # the version of the metadata's JSON layout


@dataclass(frozen=True)
class Header:
    """What one message carries; ``meta_nbytes == 0`` means "same metadata as last time";
    ``attached``: the loss (of ``loss_dtype``) follows the payload as its own part;
    ``count_attached``: that part starts with the micro-batch's count (``count`` is then -1);
    ``version``: the micro-batch's weight version tag (PipeDream; -1: none)."""

    kind: int
    microbatch: int
    dst_stage: int  # the receiving rank's virtual stage the message is for
    num_microbatches: int
    batch_size: int
    meta_nbytes: int
    payload_nbytes: int
    step: int
    loss: Optional[float] = None  # gradients carry their micro-batch's loss to every rank
    loss_dtype: torch.dtype = torch.float32
    count: float = -1.0  # with (loss_sum, count) losses: the micro-batch's count (else -1)
    attached: bool = False
    count_attached: bool = False
    version: int = -1

    @property
    def loss_nbytes(self) -> int:
        """Bytes of the attached loss part, the count's included (0: none)."""
        if not self.attached:
            return 0
        return self.loss_dtype.itemsize + (COUNT_DTYPE.itemsize if self.count_attached else 0)

    def _loss_code(self) -> int:
        if self.loss is None and not self.attached:
            return NO_LOSS
        return (LOSS_DTYPES.index(self.loss_dtype) + (ATTACHED if self.attached else 0)
                + (COUNTED if self.count_attached else 0))

    def encode(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind, self.microbatch, self.dst_stage,
                             self.num_microbatches, self.batch_size, self.meta_nbytes,
                             self.payload_nbytes, self.step,
                             _bits(math.nan if self.loss is None else self.loss),
                             self._loss_code(), _bits(self.count), self.version],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, values: torch.Tensor) -> "Header":
        raw = [int(v) for v in values.tolist()]
        if len(raw) != HEADER_LEN or raw[0] != MAGIC:
            raise ValueError(f"corrupt pipeline message header {raw}: the ranks disagree on the "
                             f"schedule or another library uses the same tags")
        if raw[12] < -1:
            raise ValueError(f"corrupt pipeline message header {raw}: weight version {raw[12]}")
        if raw[10] == NO_LOSS:
            return cls(*raw[1:9], count=_float(raw[11]), version=raw[12])
        attached, counted, code = ((raw[10] & ATTACHED) > 0, (raw[10] & COUNTED) > 0,
                                   raw[10] % ATTACHED)
        if not 0 <= raw[10] < 2 * COUNTED or code >= len(LOSS_DTYPES) or counted > attached:
            raise ValueError(f"corrupt pipeline message header {raw}: unknown loss dtype code")
        return cls(*raw[1:9], loss=None if attached else _float(raw[9]),
                   loss_dtype=LOSS_DTYPES[code], count=_float(raw[11]), attached=attached,
                   count_attached=counted, version=raw[12])


def attach(loss: torch.Tensor, count: Optional[torch.Tensor]) -> torch.Tensor:
    """A gradient message's attached part, as bytes on the loss's device: the count (as
    ``COUNT_DTYPE``, first, so both stay aligned) when there is one, then the loss. Device
    work only: nothing is read on the host."""
    parts = [] if count is None else [count.detach().reshape(1).to(loss.device, COUNT_DTYPE)]
    parts.append(loss.detach().reshape(1))
    return torch.cat([p.view(torch.uint8) for p in parts])


def detach_attached(header: Header, part: torch.Tensor
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The loss (0-dim, of ``header.loss_dtype``) and the count (0-dim ``COUNT_DTYPE``, or
    ``None``) of a received attached part: views of it, still on its device."""
    start = COUNT_DTYPE.itemsize if header.count_attached else 0
    loss = part[start:].view(header.loss_dtype).reshape(())
    count = part[:start].view(COUNT_DTYPE).reshape(()) if header.count_attached else None
    return loss, count


class HostReads:
    """The one way a training step reads a buffer of its device on the host (``.cpu()``, a
    number, a flag): on a GPU each read makes the host wait for the work queued before it, so
    the host cannot run ahead. The step's transport and the close of its gradients share one
    counter (``StepState.reads``). Every read is counted, on any device, so a CPU run reports
    what the same code path does on a GPU (``pipe.last_step.host_reads``)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()  # a Pipe's worker threads may read at once

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the CPU (counted)."""
        with self._lock:
            self.count += 1
        return tensor.cpu()

    def number(self, tensor: torch.Tensor) -> float:
        """A one-element tensor's value (counted)."""
        return float(self.read(tensor))

    def values(self, tensor: torch.Tensor) -> List[float]:
        """A tensor's values as floats, in one read (counted)."""
        return [float(v) for v in self.read(tensor).reshape(-1).tolist()]


def _bits(value: float) -> int:
    """A float64's bits as an int64 (headers are int64 tensors)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Meta:
    """The structure of a message: pytree spec, constants, grad flags and tensor layouts.

    It travels as JSON data (:mod:`.data_codec`): decoding a peer's metadata builds these
    fields and runs nothing; bytes that are not such data raise ``ProtocolError``."""

    spec: Any  # None: the message is a single tensor
    constants: List[Any]  # non-tensor leaves; None where a tensor goes
    tensor_mask: List[bool]  # which leaves are tensors
    requires_grad: List[bool]
    layouts: List[Optional[Tuple[torch.dtype, Tuple[int, ...]]]]  # None: a missing gradient

    def encode(self) -> torch.Tensor:
        """The metadata as bytes (``TypeError`` for a non-tensor leaf that is not data)."""
        data = [FORMAT, None if self.spec is None else codec.encode_spec(self.spec),
                [codec.encode_value(c) for c in self.constants], list(self.tensor_mask),
                list(self.requires_grad),
                [None if x is None else [codec.dtype_name(x[0]), [int(n) for n in x[1]]]
                 for x in self.layouts]]
        return torch.frombuffer(bytearray(codec.dumps(data)), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor, sender: int) -> "Meta":
        """The metadata rank ``sender`` sent (``ProtocolError`` if the bytes are not what
        :meth:`encode` writes)."""
        try:
            return cls._fields_of(codec.loads(data.numpy().tobytes()))
        except Exception as error:  # noqa: BLE001 - whatever the bytes make fail: undecodable
            raise ProtocolError(
                f"rank {sender} sent pipeline message metadata that does not decode "
                f"({type(error).__name__}: {error}): a corrupt or forged message, or a rank "
                f"running other code (every rank must run the same fastpipe and model code); "
                f"nothing in it was run", rank=sender) from None

    @classmethod
    def _fields_of(cls, data: Any) -> "Meta":
        if not (isinstance(data, list) and len(data) == 6 and data[0] == FORMAT):
            raise codec.Undecodable(f"not metadata of format {FORMAT}")
        spec = None if data[1] is None else codec.decode_spec(data[1])
        constants = [codec.decode_value(c) for c in codec.check_list(data[2], "constants")]
        mask = codec.check_list(data[3], "the tensor mask", bool)
        grads = codec.check_list(data[4], "the gradient flags", bool)
        layouts = [None if x is None else _layout(x)
                   for x in codec.check_list(data[5], "the layouts")]
        if len(mask) != len(constants) or any(c is not None for c, t in zip(constants, mask)
                                              if t):
            raise codec.Undecodable("the constants and the tensor mask disagree")
        if spec is not None and spec.num_leaves != len(constants):
            raise codec.Undecodable(f"a pytree of {spec.num_leaves} leaves with "
                                    f"{len(constants)} constants")
        return cls(spec, constants, mask, grads, layouts)


def _layout(data: Any) -> Tuple[torch.dtype, Tuple[int, ...]]:
    if not (isinstance(data, list) and len(data) == 2 and isinstance(data[0], str)
            and isinstance(data[1], list) and all(type(n) is int and n >= 0 for n in data[1])):
        raise codec.Undecodable(f"a malformed tensor layout {data!r}"[:200])
    return codec.dtype_of(data[0]), tuple(data[1])


def layouts_of(tensors: Sequence[Optional[torch.Tensor]]
               ) -> List[Optional[Tuple[torch.dtype, Tuple[int, ...]]]]:
    return [None if t is None else (t.dtype, tuple(t.shape)) for t in tensors]


def _nbytes(layout: Tuple[torch.dtype, Tuple[int, ...]]) -> int:
    dtype, shape = layout
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_size(layouts: Sequence[Optional[Tuple[torch.dtype, Tuple[int, ...]]]]) -> int:
    """Bytes of the payload for these layouts (packed form when there are several tensors)."""
    present = [x for x in layouts if x is not None]
    if len(present) == 1:
        return _nbytes(present[0])
    return sum(_aligned(_nbytes(x)) for x in present)


def pack(tensors: Sequence[Optional[torch.Tensor]],
         backend: StreamBackend = HOST) -> Optional[torch.Tensor]:
    """The payload to send, as bytes: the one tensor's own memory (no copy when it is
    contiguous), or the tensors copied into one aligned byte buffer, allocated and written
    through ``backend`` on the current stream (a non-contiguous tensor is copied straight into
    its place: no hidden temporary). The caller keeps the sources alive, or records them on the
    current stream (:meth:`fastpipe.streams.exchange.ExchangeStreams.read`), until the copies
    have read them."""
    present = [t.detach() for t in tensors if t is not None]
    if not present:
        return None
    if len(present) == 1 and present[0].is_contiguous():
        return _bytes(present[0])
    sizes = [_aligned(t.numel() * t.element_size()) for t in present]
    if len(present) == 1:
        sizes = [present[0].numel() * present[0].element_size()]
    buffer = backend.empty((sum(sizes),), torch.uint8, present[0].device)
    offset = 0
    for t, size in zip(present, sizes):
        n = t.numel() * t.element_size()
        backend.copy(buffer[offset:offset + n].view(t.dtype).view(t.shape), t)
        offset += size
    return buffer


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def unpack(buffer: torch.Tensor, layouts: Sequence[Optional[Tuple[torch.dtype, Tuple[int, ...]]]]
           ) -> List[Optional[torch.Tensor]]:
    """The tensors of a received byte payload, in order (``None`` where the layout is
    ``None``); views into ``buffer``."""
    out: List[Optional[torch.Tensor]] = []
    offset = 0
    for layout in layouts:
        if layout is None:
            out.append(None)
            continue
        dtype, shape = layout
        n = _nbytes(layout)
        out.append(buffer[offset:offset + n].view(dtype).view(shape))
        offset += _aligned(n)
    return out
