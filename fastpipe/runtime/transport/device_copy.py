"""Moving one stage's boundary tensors to the next stage's device, with stream ordering.

On the CPU a hop is a plain (possibly zero-copy) move. On CUDA the copy goes through the
``fastpipe::transfer`` op, which runs it on a dedicated copy stream of the (source, destination)
pair and orders the destination's current stream after it; an event is then recorded on that
stream, and the receiving stage's stream waits on it before it touches the tensors (which are
recorded on the receiving stream, so the caching allocator cannot hand their memory out early).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ...ops.transfer import transfer


@dataclass
class Parcel:
    """Tensors already on (or being copied to) the receiver's device, plus their ready event."""

    tensors: List[Optional[torch.Tensor]]
    event: Optional["torch.cuda.Event"] = None


def ship(tensors: Sequence[Optional[torch.Tensor]], device: torch.device) -> Parcel:
    """Start moving ``tensors`` (``None`` entries kept) to ``device``; returns a ``Parcel``."""
    if device.type == "cpu" and all(t is None or t.is_cpu for t in tensors):
        return Parcel(list(tensors))  # the hop between CPU stages: nothing moves
    present = [t for t in tensors if t is not None]
    moved = iter(transfer(present, device))
    out = [None if t is None else next(moved) for t in tensors]
    event = None
    if device.type == "cuda" and present:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return Parcel(out, event)


def land(parcel: Parcel, device: torch.device) -> List[Optional[torch.Tensor]]:
    """Make the receiver's current stream wait for the parcel and take ownership of it."""
    if parcel.event is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(parcel.event)
        for t in parcel.tensors:
            if t is not None and t.is_cuda:
                t.record_stream(stream)
    return parcel.tensors
