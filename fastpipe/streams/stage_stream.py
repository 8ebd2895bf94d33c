"""A stage's own stream: its work is issued there, under its device's guard, ordered after the
caller's work when a step starts, and the caller's work is ordered after it when the step ends.

Before a step, each stage's stream waits for the caller's current stream on its device (the
parameters the optimizer just updated, the inputs just made there); after it, the caller's
stream waits for each stage's (gradients, outputs and losses are read there next). No
``record_stream`` is needed at these two boundaries: a stage's memory that the caller reads
(gradients, outputs) returns to the stage's pool when freed, and is reused only by that stage's
work issued after the next step's start, ordered after the caller's; the caller's memory that
the stages read (parameters, inputs) is reused on the caller's stream, which by then has waited
for the stages.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .backend import StreamBackend, backend_for

__all__ = ["caller_after_stage", "issuing", "stage_after_caller"]


@contextlib.contextmanager
def issuing(stream: Any, device: torch.device,
            backend: Optional[StreamBackend] = None) -> Iterator[None]:
    """Inside the block, ``device`` is the current device and ``stream`` its current stream."""
    backend = backend or backend_for(device)
    with backend.on_device(device), backend.using(stream):
        yield


def stage_after_caller(device: torch.device, stream: Any,
                       backend: Optional[StreamBackend] = None) -> None:
    """Before a step: the stage's ``stream`` waits for the caller's current stream on
    ``device``."""
    backend = backend or backend_for(device)
    backend.wait_stream(stream, backend.current(device))


def caller_after_stage(device: torch.device, stream: Any,
                       backend: Optional[StreamBackend] = None) -> None:
    """After a step: the caller's current stream on ``device`` waits for the stage's
    ``stream``."""
    backend = backend or backend_for(device)
    backend.wait_stream(backend.current(device), stream)
