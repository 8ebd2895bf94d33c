"""What the close of a training step learns from the device, in one read.

A step's host must know a few facts to end it (the gradient norm terms, and where a gradient, a
loss or a count first went wrong). Each is computed where its tensors live, as a one-element
tensor nobody reads, and :func:`read_together` reads them all at once: on a GPU the host then
waits for the device once per step, not once per micro-batch or per parameter.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

if TYPE_CHECKING:
    from ..transport.wire import HostReads


def first_marked(marks: torch.Tensor, labels: Sequence[int]) -> torch.Tensor:
    """On ``marks``' device, unread: the label of the first true mark, else -1 (a 0-dim
    float64)."""
    labelled = torch.tensor(labels, dtype=torch.float64).to(marks.device)
    first = torch.where(marks, labelled, math.inf).min()
    return torch.where(torch.isinf(first), -1.0, first)


def read_together(values: Sequence[Optional[torch.Tensor]],
                  reads: "HostReads") -> List[Optional[float]]:
    """Each one-element tensor of ``values`` as a number (``None`` stays ``None``), in one
    counted read, or none when every value is ``None``."""
    present = [v for v in values if v is not None]
    if not present:
        return [None] * len(values)
    home = present[0].device
    numbers = iter(reads.values(torch.stack([v.reshape(()).to(home, torch.float64)
                                             for v in present])))
    return [None if v is None else next(numbers) for v in values]
