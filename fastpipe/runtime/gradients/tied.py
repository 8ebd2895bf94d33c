"""Tied parameters across pipeline ranks: one copy per rank that uses it, kept identical.

A parameter that layers on several ranks share (an embedding and the LM head) cannot be one
``nn.Parameter`` across processes. Each of those ranks keeps a copy; the copies start equal (the
first stage's value is broadcast) and, after every step, their gradients are summed over the
pipeline's ranks, so every copy holds the gradient of the tied parameter and identical optimizer
steps keep the copies equal. Only what the step (or the calls of a ``no_sync()`` block) added is
summed: a gradient accumulated over earlier calls is set aside when the step begins and added
back after the sum, so accumulating over ``train_step`` calls gives the plain model's sum. The
collectives run over the pipeline group (ranks that do not hold the parameter take part with
zeros), so no extra process groups are needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..failure.board import Board
from ..failure.waits import wait_work


@dataclass
class _Shared:
    names: Sequence[str]
    home: int  # global rank of the first stage that uses it
    holders: Sequence[int]  # global ranks with a copy
    shape: torch.Size
    dtype: torch.dtype
    local: Optional[torch.nn.Parameter]  # this rank's copy, if it holds one


class TiedSync:
    """Keeps the copies of cross-rank tied parameters equal (``fastpipe.tied.TiedWeight`` list)."""

    def __init__(self, tied: Sequence[Any], owner: Sequence[int], group: Any,
                 device: torch.device, board: Board, timeout: float) -> None:
        rank = dist.get_rank()
        self.rank = rank
        self.group, self.device, self.board, self.timeout = group, device, board, timeout
        self.shared: List[_Shared] = []
        self._before: Optional[List[Optional[torch.Tensor]]] = None  # set aside by begin()
        for weight in tied:
            holders = sorted({owner[s] for s in weight.stages})
            if len(holders) < 2:
                continue  # on one rank the layers share the very Parameter
            self.shared.append(_Shared(weight.names, owner[weight.stages[0]], holders,
                                       weight.parameter.shape, weight.parameter.dtype,
                                       weight.parameter if rank in holders else None))

    def _collective(self, value: torch.Tensor, what: str, src: Optional[int] = None) -> None:
        work = (dist.broadcast(value, src=src, group=self.group, async_op=True) if src is not None
                else dist.all_reduce(value, group=self.group, async_op=True))
        wait_work(work, self.timeout, what, self.board)

    def broadcast_initial(self) -> None:
        """Give every copy the value of the first stage's copy."""
        for s in self.shared:
            value = (s.local.detach().clone() if s.local is not None
                     else torch.empty(s.shape, dtype=s.dtype, device=self.device))
            self._collective(value, f"the initial value of tied {s.names[0]!r}", src=s.home)
            if s.local is not None:
                with torch.no_grad():
                    s.local.copy_(value)

    def away(self) -> List[torch.nn.Parameter]:
        """This rank's copies of weights whose home is another rank (counted there)."""
        return [s.local for s in self.shared if s.local is not None and s.home != self.rank]

    def begin(self) -> None:
        """A training step begins: set the copies' accumulated gradients aside (unless a
        ``no_sync()`` window already did), so that the sum covers only what is new."""
        if self._before is not None or not self.shared:
            return
        self._before = []
        for s in self.shared:
            self._before.append(s.local.grad if s.local is not None else None)
            if s.local is not None:
                s.local.grad = None

    def sum_gradients(self) -> None:
        """Sum what the copies' gradients gained since :meth:`begin` over the ranks that hold
        them, then add back what was set aside."""
        before, self._before = self._before or [None] * len(self.shared), None
        for s, prior in zip(self.shared, before):
            if s.local is not None and s.local.grad is not None:
                value = s.local.grad
            else:
                value = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            self._collective(value, f"the gradient sum of tied {s.names[0]!r}")
            if s.local is not None:
                s.local.grad = value if prior is None else prior.add_(value)
