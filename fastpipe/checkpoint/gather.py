"""Every rank's share of a pipe's model state, gathered in one process.

A format that one process writes (Hugging Face's ``save_pretrained``, a PEFT adapter) needs the
whole model's state dict. On a ``DistributedPipe`` each rank holds its stages' share, under the
plain model's names (tensor-parallel and FSDP parameters as ``DTensor`` shards): every rank
calls :func:`full_state_dict`, each shard group gathers its full tensors, one rank per stage
(the first of its data, shard and tensor groups) sends its entries, and rank 0 receives the
union. A weight tied across ranks arrives under each name that its ranks give it, with equal
values. Every wait is bounded by the pipe's timeout (or ``timeout``) and names what it waited
for.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistributedPipe
from ..runtime.failure.waits import wait_work


def full_state_dict(pipe: nn.Module, *, timeout: Optional[float] = None
                    ) -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's state dict under the plain model's names, as detached CPU tensors.

    With a ``DistributedPipe`` this is a collective: every rank calls it, rank 0 gets the state
    dict and the other ranks ``None``. With a ``Pipe`` or a plain module, its own state dict.
    """
    if not isinstance(pipe, nn.Module):
        raise TypeError(f"pipe must be a fastpipe pipe or an nn.Module, got {type(pipe).__name__}")
    if not isinstance(pipe, DistributedPipe):
        return {name: _full(value).detach().cpu() for name, value in pipe.state_dict().items()}
    wait = _Waits(pipe, timeout)
    local = {name: _full(value).detach().cpu() for name, value in sorted(pipe.state_dict().items())}
    payload = _pack(local if _sends(pipe) else {})
    parts = wait.gather_to_first(payload, "the model state every rank holds")
    if parts is None:
        return None
    merged: Dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in _unpack(part).items():
            merged.setdefault(name, value)
    return merged


def _full(value: Any) -> Any:
    """A ``DTensor``'s whole value (a collective over its mesh), any other value as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _sends(pipe: DistributedPipe) -> bool:
    """Whether this rank sends its entries: one rank per stage, the first of its data-parallel,
    shard and tensor-parallel groups (their entries are the same)."""
    mesh = pipe.mesh
    if mesh is None:
        return True
    return all(mesh.coordinate(dim) == 0 for dim in ("data", "shard", "tensor"))


def _pack(state: Dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


class _Waits:
    """This rank's bounded collectives over the default process group."""

    def __init__(self, pipe: DistributedPipe, timeout: Optional[float]) -> None:
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r}; give a positive number of seconds, or None "
                             f"for the pipe's own timeout")
        self.timeout = float(timeout) if timeout is not None else pipe.layout.timeout
        self.device = pipe.device
        self.stages = list(pipe.stages)
        self.board = pipe._driver.board
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather_to_first(self, payload: bytes, what: str) -> Optional[List[bytes]]:
        """Every rank's ``payload`` on rank 0, in rank order (``None`` elsewhere)."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
            else torch.zeros(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._wait(dist.all_gather(sizes, size, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data.to(self.device)
        parts = [torch.zeros_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        self._wait(dist.gather(padded, parts, dst=0, async_op=True), what)
        if parts is None:
            return None
        return [bytes(p[:int(s.item())].cpu().numpy().tobytes()) for p, s in zip(parts, sizes)]

    def _wait(self, work: Any, what: str) -> None:
        wait_work(work, self.timeout, f"the other ranks at {what} (stages {self.stages})",
                  self.board)
