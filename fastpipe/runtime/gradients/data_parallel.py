"""Data-parallel gradient averaging for pipeline stages, overlapped with the rest of the step.

When a stage's last backward of the step ends, its gradients are final: they are packed into
buckets and all-reduced across the stage's data-parallel replicas asynchronously while the other
stages of this rank (and the rest of the pipeline) keep computing. ``finish`` waits for the
reductions (bounded, watching the failure board) and writes the averages back.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..failure.board import Board
from ..failure.waits import wait_work

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
        for bucket in buckets(grads):
            flat = _flatten_dense_tensors(bucket)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((work, flat, bucket, what))

    def finish(self) -> None:
        """Wait for every launched reduction and write the averaged gradients back."""
        pending, self._pending = self._pending, []
        for work, flat, bucket, what in pending:
            wait_work(work, self.timeout, f"the data-parallel gradient all-reduce of {what}",
                      self.board)
            flat.div_(self.size)
            for g, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(averaged)
