"""Activation offload's copies: a saved tensor out to a host buffer and back, each on a side
stream, ordered so that neither copy touches memory another stream may still use.

- Out: the out-stream waits for the stage's stream (the saved tensor was computed there),
  copies into the host buffer, and is recorded on the tensor (the stage frees it at once; the
  allocator must not hand the memory out before the copy has read it).
- In: the destination is allocated on the in-stream, from its own pool: a block from the
  stage's pool may have just been freed by the stage's queued kernels (the previous
  micro-batch's backward), which the in-stream is not ordered after. The in-stream waits for
  the out-copy's event (the host buffer is written), copies, and marks the end with an event.
- Ready: the stream that unpacks the tensor in backward waits for that event and is recorded
  on the tensor, which it uses from then on.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .backend import StreamBackend, backend_for

__all__ = ["OffloadCopies"]


class OffloadCopies:
    """The out and in copies of one stage's offloaded tensors (see the module docstring)."""

    def __init__(self, device: torch.device, backend: Optional[StreamBackend] = None) -> None:
        self.device = torch.device(device)
        self.backend = backend or backend_for(self.device)
        self.out_stream = self.backend.new_stream(self.device)
        self.in_stream = self.backend.new_stream(self.device)

    def copy_out(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        """Copy ``tensor`` into ``host`` after the current stream's work; the copy's event."""
        b = self.backend
        b.wait_stream(self.out_stream, b.current(self.device))
        with b.using(self.out_stream):
            b.copy(host, tensor)
            done = b.record_event(self.out_stream)
        b.record_stream(tensor, self.out_stream)
        return done

    def copy_in(self, host: torch.Tensor, copied: Any) -> Tuple[torch.Tensor, Any]:
        """A new device tensor filled from ``host`` once ``copied`` (its out-copy) has
        completed, allocated from the in-stream's pool; the tensor and its ready event."""
        b = self.backend
        with b.using(self.in_stream):
            value = b.empty(host.shape, host.dtype, self.device)
            b.wait_event(self.in_stream, copied)
            b.copy(value, host)
            done = b.record_event(self.in_stream)
        return value, done

    def ready(self, value: torch.Tensor, fetched: Any) -> None:
        """Order the current stream after ``value``'s in-copy and record it there."""
        b = self.backend
        stream = b.current(self.device)
        b.wait_event(stream, fetched)
        b.record_stream(value, stream)

    def done(self, event: Any) -> bool:
        """Whether the copy that ``event`` marks has completed (never blocks)."""
        return self.backend.done(event)
