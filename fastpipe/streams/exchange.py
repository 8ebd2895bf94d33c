"""The grouped exchange's streams: a rank's messages are packed, sent and received on one
communication stream, ordered against the rank's stage streams.

- Posting a group: the communication stream waits for every local stage's stream (the
  messages were computed there), then the pack, the sends and the receives are issued on it
  (NCCL orders its own stream after the current one, and ``work.wait()`` the current one after
  NCCL's). Buffers the exchange allocates (packed payloads, fillers, receive buffers) come
  from the communication stream's pool.
- Packing: the pack reads each message tensor on the communication stream, while the tensor
  belongs to a stage's pool; the message may hold its only reference (a checkpointed
  micro-batch's activation, an input gradient), so each is recorded on the communication
  stream before the message is dropped: the stage cannot reuse the memory before the pack
  has read it.
- Finishing a group: its waits are issued on the communication stream, then every local
  stage's stream waits for it; each received buffer, allocated from the communication
  stream's pool, is recorded on every stage stream that may use it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Optional

import torch

from .backend import StreamBackend, backend_for

__all__ = ["ExchangeStreams"]


class ExchangeStreams:
    """The communication stream of one rank's grouped exchange (see the module docstring).
    ``stages`` are the local stages' streams, set for each step."""

    def __init__(self, device: torch.device, backend: Optional[StreamBackend] = None) -> None:
        self.device = torch.device(device)
        self.backend = backend or backend_for(self.device)
        self.stages: List[Any] = []
        self._stream: Optional[Any] = None
        self._made = False

    @property
    def stream(self) -> Any:
        """The communication stream (made on first use; ``None`` on the CPU)."""
        if not self._made:
            self._stream, self._made = self.backend.new_stream(self.device), True
        return self._stream

    @contextlib.contextmanager
    def posting(self) -> Iterator[None]:
        """Issue the block on the communication stream, after every stage's work so far."""
        b = self.backend
        for stage in self.stages:
            b.wait_stream(self.stream, stage)
        with b.on_device(self.device), b.using(self.stream):
            yield

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """Issue the block on the communication stream; every stage's stream waits for it."""
        b = self.backend
        with b.on_device(self.device), b.using(self.stream):
            yield
        for stage in self.stages:
            b.wait_stream(stage, self.stream)

    def read(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Record ``tensors`` (a message's, just packed) on the communication stream."""
        for t in tensors:
            if t is not None:
                self.backend.record_stream(t, self.stream)

    def hand_over(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Record received ``tensors`` on every stage's stream, which will use them."""
        for t in tensors:
            if t is not None:
                for stage in self.stages:
                    self.backend.record_stream(t, stage)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` uninitialised bytes on the device, from the current stream's pool (the
        communication stream's, inside :meth:`posting` or :meth:`finishing`)."""
        return self.backend.empty((nbytes,), torch.uint8, self.device)

    def filler(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` zero bytes (what phase 1 sends in a resized part's place)."""
        return self.buffer(nbytes).zero_()

