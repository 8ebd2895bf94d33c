"""Data-parallel gradient averaging for pipeline stages, overlapped with the rest of the step.

When a stage's last backward of the step ends, its gradients are final: they are packed into
buckets and all-reduced across the stage's data-parallel replicas asynchronously while the other
stages of this rank (and the rest of the pipeline) keep computing. ``finish`` waits for the
reductions (bounded, watching the failure board) and writes the averages back.

Under PipeDream each stage updates after every micro-batch's backward, so its replicas average
that micro-batch's gradient right then (``average_now``), and every replica applies the same
update.
"""
from __future__ import annotations

import time
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..failure.board import Board
from ..failure.timeouts import Waiting
from ..failure.waits import wait_until, wait_work

BUCKET_BYTES = 25 * 2 ** 20


def buckets(grads: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> List[List[torch.Tensor]]:
    """Group gradients, in order, into buckets of one dtype and device of at most ``limit``
    bytes (a larger gradient gets a bucket of its own)."""
    out: List[List[torch.Tensor]] = []
    size = 0
    for g in grads:
        n = g.numel() * g.element_size()
        last = out[-1] if out else None
        if (last is None or last[0].dtype != g.dtype or last[0].device != g.device
                or size + n > limit):
            out.append([g])
            size = n
        else:
            last.append(g)
            size += n
    return out


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a tensor-parallel ``DTensor``'s local shard, whose
    storage it shares), reduced over the data-parallel group like any other tensor."""
    to_local = getattr(grad, "to_local", None)
    if to_local is None:
        return grad
    with torch.no_grad():
        return to_local()


class GradSync:
    """Averages stage gradients over a data-parallel group."""

    def __init__(self, group: Any, board: Board, timeout: float) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.board = board
        self.timeout = timeout
        self._pending: List[Tuple[Any, torch.Tensor, List[torch.Tensor], str]] = []

    def launch(self, parameters: Sequence[torch.nn.Parameter], what: str) -> None:
        """Start averaging the gradients of ``parameters`` (those that have one)."""
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        self._pending += self._launch(grads, what)

    def _launch(self, grads: Sequence[torch.Tensor], what: str
                ) -> List[Tuple[Any, torch.Tensor, List[torch.Tensor], str]]:
        launched = []
        for bucket in buckets(grads):
            flat = _flatten_dense_tensors(bucket)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            launched.append((work, flat, bucket, what))
        return launched

    def finish(self) -> None:
        """Wait for every launched reduction and write the averaged gradients back."""
        pending, self._pending = self._pending, []
        for work, flat, bucket, what in pending:
            wait_work(work, self.timeout, f"the data-parallel gradient all-reduce of {what}",
                      self.board)
            self._write_back(flat, bucket)

    def average_now(self, grads: Sequence[torch.Tensor], waiting: Waiting) -> None:
        """Average ``grads`` over the replicas in place before returning (PipeDream: one
        micro-batch's gradients, before the stage updates with them); the wait is bounded by
        the pipe's timeout, its error as ``waiting`` says (rank, stage, action, micro-batch)."""
        deadline = time.monotonic() + self.timeout
        for work, flat, bucket, _ in self._launch([_local(g) for g in grads], waiting.what):
            wait_until(work, waiting, self.board, deadline)
            self._write_back(flat, bucket)

    def _write_back(self, flat: torch.Tensor, bucket: List[torch.Tensor]) -> None:
        flat.div_(self.size)
        for g, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(averaged)
