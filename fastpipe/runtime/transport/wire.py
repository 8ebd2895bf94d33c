"""The wire format of messages between pipeline ranks: a fixed header, cached metadata, payload.

Every message (an activation or a gradient of one micro-batch) travels as:

1. a header of ``HEADER_LEN`` int64 values: what the message is (kind, micro-batch, the
   receiving stage), the step's micro-batch count and batch size, the byte counts of what
   follows, and (for gradients) the micro-batch's loss, so every rank learns the step's loss
   from the gradients it receives, without a collective (the grouped transport sends the loss
   tensor itself next to the payload, ``attached``: its value never has to reach the host);
2. the metadata (tensor dtypes and shapes, the pytree structure, non-tensor leaves), pickled,
   only when it differs from the previous message of the same kind to the same stage: the
   receiver caches it, so
   a stream of same-shaped micro-batches sends it once, and a new sequence length costs one
   small extra message, never padding;
3. the payload, as bytes: the single tensor's own memory, or several tensors packed into one
   byte buffer (one transfer instead of many).

Pure functions on tensors and bytes, no communication: tested without processes. A transport
reads a buffer of its device on the host only through :class:`HostReads`, which counts the
reads (``pipe.last_step.host_reads``).
"""
from __future__ import annotations

import math
import pickle
import struct
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

MAGIC = 0x66_70_70_31  # "fpp1"
HEADER_LEN = 12
# The dtypes a loss may have, by the code a header carries (the loss comes back in its own dtype).
LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NO_LOSS = 255  # the loss dtype code of a header that carries no loss (any loss, NaN included,
# travels with its own dtype code: a NaN loss is a loss, never "unknown")
ATTACHED = 64  # added to the loss dtype code: the loss travels as its own part, not in the header
ALIGN = 16  # bytes: every packed tensor starts at a multiple (any dtype can view it)


@dataclass(frozen=True)
class Header:
    """What one message carries; ``meta_nbytes == 0`` means "same metadata as last time";
    ``attached``: the loss (of ``loss_dtype``) follows the payload as its own part."""

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

    @property
    def loss_nbytes(self) -> int:
        """Bytes of the attached loss part (0: none)."""
        return self.loss_dtype.itemsize if self.attached else 0

    def _loss_code(self) -> int:
        if self.loss is None and not self.attached:
            return NO_LOSS
        return LOSS_DTYPES.index(self.loss_dtype) + (ATTACHED if self.attached else 0)

    def encode(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind, self.microbatch, self.dst_stage,
                             self.num_microbatches, self.batch_size, self.meta_nbytes,
                             self.payload_nbytes, self.step,
                             _bits(math.nan if self.loss is None else self.loss),
                             self._loss_code(), _bits(self.count)],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, values: torch.Tensor) -> "Header":
        raw = [int(v) for v in values.tolist()]
        if len(raw) != HEADER_LEN or raw[0] != MAGIC:
            raise ValueError(f"corrupt pipeline message header {raw}: the ranks disagree on the "
                             f"schedule or another library uses the same tags")
        if raw[10] == NO_LOSS:
            return cls(*raw[1:9], count=_float(raw[11]))
        attached, code = raw[10] >= ATTACHED, raw[10] % ATTACHED
        if not 0 <= raw[10] < 2 * ATTACHED or code >= len(LOSS_DTYPES):
            raise ValueError(f"corrupt pipeline message header {raw}: unknown loss dtype code")
        return cls(*raw[1:9], loss=None if attached else _float(raw[9]),
                   loss_dtype=LOSS_DTYPES[code], count=_float(raw[11]), attached=attached)


class HostReads:
    """The one way a transport reads a buffer of its device on the host (``.cpu()``, or a
    number): on a GPU each read makes the host wait for the work queued before it, so the host
    cannot run ahead. Every read is counted, on any device, so a CPU run reports what the same
    code path does on a GPU (``pipe.last_step.host_reads``)."""

    def __init__(self) -> None:
        self.count = 0

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the CPU (counted)."""
        self.count += 1
        return tensor.cpu()

    def number(self, tensor: torch.Tensor) -> float:
        """A one-element tensor's value (counted)."""
        return float(self.read(tensor))


def _bits(value: float) -> int:
    """A float64's bits as an int64 (headers are int64 tensors)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Meta:
    """The structure of a message: pytree spec, constants, grad flags and tensor layouts."""

    spec: Any  # None: the message is a single tensor
    constants: List[Any]  # non-tensor leaves; None where a tensor goes
    tensor_mask: List[bool]  # which leaves are tensors
    requires_grad: List[bool]
    layouts: List[Optional[Tuple[torch.dtype, Tuple[int, ...]]]]  # None: a missing gradient

    def encode(self) -> torch.Tensor:
        data = pickle.dumps((self.spec, self.constants, self.tensor_mask, self.requires_grad,
                             self.layouts))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> "Meta":
        with warnings.catch_warnings():  # torch's pytree warns about its own leaf specs
            warnings.simplefilter("ignore", FutureWarning)
            return cls(*pickle.loads(data.numpy().tobytes()))


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


def pack(tensors: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The payload to send, as bytes: the one tensor's own memory (no copy when it is
    contiguous), or all tensors copied into one aligned byte buffer."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    if len(present) == 1:
        return _bytes(present[0].detach().contiguous())
    sizes = [_aligned(t.numel() * t.element_size()) for t in present]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=present[0].device)
    offset = 0
    for t, size in zip(present, sizes):
        n = t.numel() * t.element_size()
        buffer[offset:offset + n].copy_(_bytes(t.detach().contiguous()))
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
