"""Distributed cases: failures, and how every rank learns of them.

Layers that raise, hang or kill their process mid-step (forward or backward), ranks that never
build their pipe, detached losses, targets of the wrong size and stage boundaries that do not
fit: every surviving rank must stop in time with an error naming the culprit.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
from dist_common import WIDTH, DistributedPipe, data, model
from torch import nn


def detached_loss() -> Dict:
    """A detached loss fails the step on every rank before any gradient is written (the last
    rank raises LossFunctionError, the others stop)."""
    fresh = DistributedPipe(model(), chunks=3, timeout=30)
    try:
        fresh.train_step(*data(10), lambda o, t: nn.functional.mse_loss(o, t).detach())
        error = None
    except Exception as caught:  # noqa: BLE001 - reported to the test
        error = type(caught).__name__
    return {"detached": error, "untouched": all(p.grad is None for p in fresh.parameters())}


class UserBoom(ValueError):
    """A user's own exception type: it must reach the caller as itself."""


class Boom(nn.Module):
    """Raises in the forward of the micro-batch whose first element is tagged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise UserBoom("boom in a user layer")
        return x


class Hang(nn.Module):
    """Stalls (longer than the pipe's timeout) on a micro-batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            time.sleep(8.0)
        return x


class Die(nn.Module):
    """Kills its process (no Python cleanup) when it sees a micro-batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            os._exit(17)
        return x


def failure(kind: str, failing_rank: int, timeout: float = 20.0, linger: float = 0.0) -> Dict:
    """One rank raises (or dies) mid-step; every other rank must stop with an error naming it
    well within ``timeout``. ``linger``: the failing rank stays alive that long after raising
    (its peers must not rely on its process exiting)."""
    layers = list(model(depth=6))
    bad = {"raise": Boom, "die": Die, "hang": Hang}[kind]()
    per = len(layers) // dist.get_world_size()
    layers.insert(failing_rank * per + 1, bad)
    balance = [per] * dist.get_world_size()
    balance[failing_rank] += 1
    balance[-1] += len(layers) - sum(balance)
    pipe = DistributedPipe(nn.Sequential(*layers), chunks=4, schedule="1f1b", balance=balance,
                           timeout=timeout)
    x, y = data(7)  # micro-batches of 2, 2, 2, 1: the last one fails
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001 - reported to the test
        seconds = time.monotonic() - start
        if dist.get_rank() == failing_rank:
            time.sleep(linger)
        return {"error": type(error).__name__, "message": str(error)[:600], "seconds": seconds,
                "notes": list(getattr(error, "__notes__", []))}
    return {"error": None, "seconds": time.monotonic() - start}


class _DieInBackward(torch.autograd.Function):
    """Identity whose backward kills the process on the micro-batch of one sample."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[0] == 1:
            os._exit(19)
        return grad


class DieInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DieInBackward.apply(x)


def blame(kind: str, failing_rank: int, schedule: str = "1f1b", timeout: float = 3.0) -> Dict:
    """A rank never builds its pipe (``never``: it stalls past the others' timeout first;
    ``never_exit``: it exits at once), or dies in the backward of the step's last micro-batch
    (``die_in_backward``, after its peers have run all their actions): every surviving rank must
    fail in that step, naming it, with its parameters and optimizer untouched."""
    rank = dist.get_rank()
    if rank == failing_rank and kind == "never":
        time.sleep(timeout + 6.0)
        return {"error": None, "built": False}
    if rank == failing_rank and kind == "never_exit":
        os._exit(23)
    layers = list(model(depth=6))
    per = len(layers) // dist.get_world_size()
    dying = kind == "die_in_backward" and rank == failing_rank
    layers.insert(failing_rank * per + 1, DieInBackward() if dying else nn.Identity())
    balance = [per] * dist.get_world_size()
    balance[failing_rank] += 1
    balance[-1] += len(layers) - sum(balance)
    pipe = DistributedPipe(nn.Sequential(*layers), chunks=4, schedule=schedule, balance=balance,
                           timeout=timeout)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = data(7)  # micro-batches of 2, 2, 2, 1: the last one's backward is the rank's last
    start = time.monotonic()
    try:
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=optimizer)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error)[:1500],
                "seconds": time.monotonic() - start,
                "untouched": all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))}
    return {"error": None, "loss": float(loss)}


def bad_targets() -> Dict:
    """Targets with a batch size other than the inputs' fail on the last rank before any
    backward, and the first rank stops too."""
    pipe = DistributedPipe(model(), chunks=2, timeout=20)
    x, y = data(8)
    if dist.get_rank() == dist.get_world_size() - 1:
        y = y[:6]
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001
        return {"error": type(error).__name__, "message": str(error)[:600],
                "seconds": time.monotonic() - start,
                "grads": [p.grad is not None for p in pipe.parameters()]}
    return {"error": None}


def boundary_mismatch() -> Dict:
    """A stage whose input does not fit what the previous stage sends fails at the first step,
    on every rank, naming the rank, the stage, the action and the micro-batch."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, 4))
    pipe = DistributedPipe(model, chunks=2, balance=[2, 1], timeout=20)
    x, y = data(4)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error)[:400],
                "notes": list(getattr(error, "__notes__", []))}
    return {"error": None}
