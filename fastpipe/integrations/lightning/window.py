"""The gradients of a pipelined ``training_step``, placed where Lightning's backward puts them.

Lightning's automatic optimization runs, for each batch: ``training_step`` (the forward and
the loss), then, on the first batch of an accumulation window, ``optimizer_zero_grad``, then the
backward of ``loss / accumulate_grad_batches``; the optimizer steps after the window's last
batch. A pipeline computes a batch's loss and gradients in one step, inside ``training_step``,
before Lightning zeroes the previous window's gradients. So the first batch of a window trains
with ``.grad`` set aside and its fresh gradients are held back until Lightning's backward
(after the zeroing, which sees the gradients it would have seen); the window's later batches
accumulate in place, as the pipe's ``no_sync()`` expects; the window's last backward divides
what the window added by ``accumulate_grad_batches`` (Lightning divides each batch's loss, the
same up to rounding, and exactly when it is a power of two) and adds it to whatever the zeroing
kept (nothing, with Lightning's default ``zero_grad``).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch


class GradientWindow:
    """One accumulation window's gradients over a fixed list of parameters."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self._params: List[torch.nn.Parameter] = list(parameters)
        self._earlier: Optional[List[Optional[torch.Tensor]]] = None  # during a first batch
        self._fresh: Optional[List[Optional[torch.Tensor]]] = None  # a first batch's, held back
        self._kept: Dict[int, torch.Tensor] = {}  # what the zeroing left, by parameter index

    def before_step(self, first: bool) -> None:
        """Before the pipe's step of a batch: on a window's first batch, set ``.grad`` aside."""
        if first:
            self._earlier = [p.grad for p in self._params]
            for p in self._params:
                p.grad = None

    def after_step(self, first: bool) -> None:
        """After it (or after it failed): on a window's first batch, hold the fresh gradients
        back and put the earlier ones back for Lightning's zeroing."""
        if first and self._earlier is not None:
            self._fresh = [p.grad for p in self._params]
            for p, earlier in zip(self._params, self._earlier):
                p.grad = earlier
            self._earlier = None

    def backward(self, first: bool, last: bool, accumulate: int) -> None:
        """Lightning's backward of a batch: a first batch's held gradients go in (what the
        zeroing kept is added at the end of the window); the last batch's backward divides the
        window's sum by ``accumulate``."""
        if first and self._fresh is not None:
            for i, (p, fresh) in enumerate(zip(self._params, self._fresh)):
                if p.grad is not None:
                    self._kept[i] = p.grad
                p.grad = fresh
            self._fresh = None
        if last:
            self._finish(accumulate)

    def discard(self) -> None:
        """Drop what a batch whose backward never came held back (its step was refused)."""
        self._fresh = None

    def _finish(self, accumulate: int) -> None:
        for i, p in enumerate(self._params):
            grad = p.grad
            if grad is not None and accumulate > 1:
                grad.div_(accumulate)
            kept = self._kept.pop(i, None)
            if kept is not None:
                p.grad = kept if grad is None else kept.add_(grad)
        self._kept.clear()
