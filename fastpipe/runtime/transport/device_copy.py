"""Moving one stage's boundary tensors to the next stage's device, with stream ordering.

On the CPU a hop is a plain (possibly zero-copy) move. On CUDA the copy goes through the
``fastpipe::transfer`` op, which runs it on a dedicated copy stream of the (source, destination)
pair and orders the destination's current stream after it; the receiving stage's stream then
waits for it and takes ownership of the tensors, with the ordering of
:mod:`fastpipe.streams.handoff`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from ...ops.transfer import transfer
from ...streams import handoff
from ...streams.backend import StreamBackend, backend_for


@dataclass
class Parcel:
    """Tensors already on (or being copied to) the receiver's device, plus their ready event."""

    tensors: List[Optional[torch.Tensor]]
    event: Any = None  # None: nothing to wait for (CPU stages, received messages)


def ship(tensors: Sequence[Optional[torch.Tensor]], device: torch.device,
         backend: Optional[StreamBackend] = None) -> Parcel:
    """Start moving ``tensors`` (``None`` entries kept) to ``device``; returns a ``Parcel``."""
    if device.type == "cpu" and backend is None and all(t is None or t.is_cpu for t in tensors):
        return Parcel(list(tensors))  # the hop between CPU stages: nothing moves
    present = [t for t in tensors if t is not None]
    if not present:
        return Parcel(list(tensors))
    moved = iter(transfer(present, device))
    out = [None if t is None else next(moved) for t in tensors]
    return Parcel(out, handoff.sent(device, backend or backend_for(device)))


def land(parcel: Parcel, device: torch.device,
         backend: Optional[StreamBackend] = None) -> List[Optional[torch.Tensor]]:
    """Make the receiver's current stream wait for the parcel and take ownership of it."""
    if parcel.event is None:
        return parcel.tensors
    return handoff.landed(parcel.tensors, parcel.event, device, backend)
