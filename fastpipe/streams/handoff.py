"""The stage hand-off: one stage's boundary tensors reach the next stage's stream only after
they are written, and their memory outlives every use there.

The sender marks the tensors ready with an event on the receiving device's current stream
after the copies to that device were issued: the copy op (``fastpipe::transfer``) orders that
stream after its copy stream; for a hop between two stages of one device nothing is copied and
the stream is the producing stage's own. The receiver's current stream (its stage's) waits for
that event before touching the tensors, and is recorded on each of them: they were allocated
from another stream's pool (the copy stream's, or the producing stage's), which could otherwise
hand the memory out again while the receiver still reads it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .backend import StreamBackend, backend_for

__all__ = ["landed", "sent"]


def sent(device: torch.device, backend: Optional[StreamBackend] = None) -> Any:
    """The event a receiver on ``device`` waits for: its current stream's work so far (the
    copies just issued to it, or the producing stage's work on the same device)."""
    backend = backend or backend_for(device)
    return backend.record_event(backend.current(device))


def landed(tensors: Sequence[Optional[torch.Tensor]], event: Any, device: torch.device,
           backend: Optional[StreamBackend] = None) -> List[Optional[torch.Tensor]]:
    """``tensors`` (``None`` kept), usable on ``device``'s current stream: it waits for
    ``event`` and is recorded on each tensor."""
    backend = backend or backend_for(device)
    stream = backend.current(device)
    backend.wait_event(stream, event)
    for t in tensors:
        if t is not None:
            backend.record_stream(t, stream)
    return list(tensors)
