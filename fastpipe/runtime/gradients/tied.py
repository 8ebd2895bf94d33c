"""Tied parameters across pipeline ranks: one copy per rank that uses it, kept identical.

A parameter that layers on several ranks share (an embedding and the LM head) cannot be one
``nn.Parameter`` across processes. Each of those ranks keeps a copy; the copies start equal (the
first stage's value is broadcast) and, after every step, their gradients are summed over the
pipeline's ranks, so every copy holds the gradient of the tied parameter and identical optimizer
steps keep the copies equal. Only what the step (or the calls of a ``no_sync()`` block) added is
summed: a gradient accumulated over earlier calls is set aside when the step begins and added
back after the sum, so accumulating over ``train_step`` calls gives the plain model's sum. The
collectives run over the pipeline group (ranks that do not hold the parameter take part with
zeros), so no extra process groups are needed. A frozen parameter (``requires_grad=False``,
the base weights under a PEFT adapter) is left out: no gradient, no collective.

Under PipeDream (``fastpipe.runtime.weight_versions``) a tied weight is updated after each
micro-batch, with that micro-batch's gradient summed over its copies: each rank starts the sum
of its share as soon as its backward of the micro-batch ends (:meth:`TiedSync.start_sum`, a
collective of the pipeline's ranks on its side channel: gloo, CPU tensors, so it never queues
behind the pipeline's own device messages), and a rank waits for the sum only when it needs
it (:meth:`PendingSum.result`, bounded).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..failure.board import Board
from ..failure.timeouts import Waiting
from ..failure.waits import wait_until, wait_work
from ..transport.wire import HostReads


@dataclass
class _Shared:
    names: Sequence[str]
    home: int  # global rank of the first stage that uses it
    holders: Sequence[int]  # global ranks with a copy
    shape: torch.Size
    dtype: torch.dtype
    local: Optional[torch.nn.Parameter]  # this rank's copy, if it holds one
    parameter: torch.nn.Parameter  # the model's (every rank has it): whether it trains
    stages: Sequence[int] = field(default=())  # the virtual stages that use it, in model order


class TiedSync:
    """Keeps the copies of cross-rank tied parameters equal (``fastpipe.tied.TiedWeight`` list)."""

    def __init__(self, tied: Sequence[Any], owner: Sequence[int], group: Any,
                 device: torch.device, board: Board, timeout: float,
                 side: Optional[Any] = None) -> None:
        rank = dist.get_rank()
        self.rank = rank
        self.group, self.device, self.board, self.timeout = group, device, board, timeout
        self.side = side if side is not None else group  # the pipeline's gloo side channel
        self.shared: List[_Shared] = []
        self._before: Optional[List[Optional[torch.Tensor]]] = None  # set aside by begin()
        for weight in tied:
            holders = sorted({owner[s] for s in weight.stages})
            if len(holders) < 2:
                continue  # on one rank the layers share the very Parameter
            self.shared.append(_Shared(weight.names, owner[weight.stages[0]], holders,
                                       weight.parameter.shape, weight.parameter.dtype,
                                       weight.parameter if rank in holders else None,
                                       weight.parameter, tuple(weight.stages)))

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
            if not s.parameter.requires_grad:  # frozen (every rank alike): no gradient to sum
                continue
            if s.local is not None and s.local.grad is not None:
                value = s.local.grad
            else:
                value = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            self._collective(value, f"the gradient sum of tied {s.names[0]!r}")
            if s.local is not None:
                s.local.grad = value if prior is None else prior.add_(value)

    # ---------------------------------------------------------------- PipeDream
    def start_sum(self, index: int, share: Optional[torch.Tensor],
                  reads: HostReads) -> "PendingSum":
        """Start summing one micro-batch's gradient of tied weight ``index`` over the
        pipeline's ranks: ``share`` is this rank's (``None``: no copy here, or no gradient,
        counted as zeros). Every rank of the pipeline starts the sums of every tied weight, in
        the same order, once per micro-batch. On the side channel (CPU tensors: a GPU share is
        read on the host, counted in ``reads``)."""
        s = self.shared[index]
        # the share itself on the CPU (its use is over: the sum may overwrite it)
        value = (torch.zeros(s.shape, dtype=s.dtype) if share is None
                 else reads.read(share.detach().contiguous()))
        work = dist.all_reduce(value, group=self.side, async_op=True)
        return PendingSum(work, value, self, s.names[0])

    def trained(self) -> List[int]:
        """The indices of the tied weights that take gradients (alike on every rank)."""
        return [i for i, s in enumerate(self.shared) if s.parameter.requires_grad]


@dataclass
class PendingSum:
    """A tied weight's gradient sum of one micro-batch, in flight (PipeDream)."""

    work: Any
    value: torch.Tensor  # on the CPU: the sum once the work completed
    sync: TiedSync
    name: str

    def result(self, waiting: Waiting, device: torch.device) -> torch.Tensor:
        """The sum on ``device``, after a wait bounded by the pipe's timeout (its error as
        ``waiting`` says: rank, stage, action, micro-batch)."""
        wait_until(self.work, waiting, self.sync.board, time.monotonic() + self.sync.timeout)
        return self.value.to(device)
