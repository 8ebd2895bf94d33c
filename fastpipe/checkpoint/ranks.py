"""The processes that save or load one checkpoint together, and how they agree.

A ``DistributedPipe``'s checkpoint is written and read by every rank of the default process
group, as ``torch.distributed.checkpoint`` requires. Before any rank changes anything, the ranks
agree: each one's problem (a bad argument, a name the checkpoint lacks) is gathered, and when
any rank has one, every rank raises it, so no rank is left waiting in a collective the others
never enter. fastpipe's own gathers wait at most ``timeout`` seconds (the pipe's by default) and
name the rank, its stages and the step of the save or load that waited. A ``Pipe`` or a plain
module is one process, which agrees with itself.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist

from ..distributed import DistributedPipe
from ..parallel.optimizer_loads import OptimizerStateError
from ..runtime.failure.waits import wait_work
from . import errors
from .data_only import UnsafeCheckpointError

_TYPES: Dict[str, Type[BaseException]] = {t.__name__: t for t in (
    errors.CheckpointError, errors.IncompleteCheckpointError, errors.CheckpointMismatchError,
    UnsafeCheckpointError, OptimizerStateError, FileExistsError, FileNotFoundError, TypeError,
    ValueError)}


class Ranks:
    """This process's part in a checkpoint: its rank, the others, and bounded agreements."""

    def __init__(self, pipe: Any, timeout: Optional[float]) -> None:
        self.distributed = isinstance(pipe, DistributedPipe)
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.problem: Optional[BaseException] = None  # a bad timeout, for the agreement
        default = pipe.layout.timeout if self.distributed else 0.0
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            self.problem = ValueError(f"timeout={timeout!r}; give a positive number of "
                                      f"seconds, or None for the pipe's own timeout")
            timeout = None
        self.timeout = float(timeout) if timeout is not None else default
        self._pipe = pipe if self.distributed else None

    def gather(self, text: str, what: str) -> List[str]:
        """Every rank's ``text``, in rank order (a collective: every rank calls it)."""
        if not self.distributed:
            return [text]
        device = self._pipe.device
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8, device=device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._wait(dist.all_gather(sizes, size, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data
        parts = [torch.zeros_like(padded) for _ in range(self.world)]
        self._wait(dist.all_gather(parts, padded, async_op=True), what)
        return [bytes(p[:int(s.item())].cpu().tolist()).decode("utf-8")
                for p, s in zip(parts, sizes)]

    def union(self, flags: torch.Tensor, what: str) -> torch.Tensor:
        """Per position, whether any rank's ``flags`` is set (a collective)."""
        if not self.distributed:
            return flags
        total = flags.to(device=self._pipe.device, dtype=torch.int32)
        self._wait(dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True), what)
        return total.cpu() > 0

    def agree(self, problem: Optional[BaseException], what: str,
              same: Optional[str] = None) -> None:
        """Raise on every rank when any rank has a problem (this rank's own exception where it
        has one, else the first rank's, as the same type, naming that rank), or when the ranks
        gave different values of the argument ``same`` (``'name=value'``)."""
        if not self.distributed:
            if problem is not None:
                raise problem
            return
        text = "" if problem is None else f"{type(problem).__name__}\n{problem}"
        reports = [r.split("\0", 1) for r in self.gather(f"{same or ''}\0{text}", what)]
        if problem is not None:
            raise problem
        for rank, (_, report) in enumerate(reports):
            if report:
                kind, _, message = report.partition("\n")
                raise _TYPES.get(kind, errors.CheckpointError)(f"rank {rank}: {message}")
        given = [value for value, _ in reports]
        if len(set(given)) > 1:
            raise ValueError(f"the ranks gave different {given[0].split('=')[0]}: "
                             f"{', '.join(f'rank {r}: {v}' for r, v in enumerate(given))}; every "
                             f"rank saves and loads the same checkpoint")

    def _wait(self, work: Any, what: str) -> None:
        stages = list(self._pipe.stages)
        wait_work(work, self.timeout, f"the other ranks at {what} (stages {stages})",
                  self._pipe._driver.board)
