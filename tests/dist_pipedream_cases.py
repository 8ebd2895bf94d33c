"""Distributed cases: ``schedule='pipedream'`` across ranks against the one-process ``Pipe``.

Every rank runs the same training calls on a ``DistributedPipe`` and, in the same process, on a
``Pipe`` of the same model, data and optimizer (the reference: its stages on threads, every
weight version in one process), and compares its own parameters with the ``Pipe``'s after each
call: weight stashing and vertical sync (whose version travels in the messages' headers),
weights tied across ranks, data-parallel replicas, and waits that run past the timeout. Run by
``dist_launch.launch(..., script="dist_pipedream_cases.py")``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_common import TOL, DistributedPipe, data, main, model, tied_model  # noqa: E402
from torch import nn  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.distributed import init_mesh  # noqa: E402
from fastpipe.runtime.gradients.tied import TiedSync  # noqa: E402

LR = 0.05


def _optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _targets(y: torch.Tensor, tied: bool) -> torch.Tensor:
    return torch.cat([y, y], 1) if tied else y  # the tied model's head is WIDTH wide


def _compare(pipe: nn.Module, local: nn.Module, where: str) -> float:
    """This rank's parameters against the Pipe's (plain-model names); their sum of magnitudes."""
    after = dict(local.named_parameters(remove_duplicate=False))
    total = 0.0
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), after[name].detach(), **TOL,
                                   msg=lambda m: f"{where}, {name}: {m}")
        total += p.detach().abs().sum().item()
    return total


def versions(vertical_sync: bool, tied: bool = False, steps: int = 3, chunks: int = 4,
             batch: int = 7, checkpoint: str = "except_last", optimizer: str = "sgd") -> Dict:
    """The pipeline over every rank: after each call, this rank's weights equal the Pipe's
    (``batch`` 7 in 4 micro-batches: 2, 2, 2, 1)."""
    world = dist.get_world_size()
    build = tied_model if tied else model
    balance = [8 // world] * world
    local = fastpipe.Pipe(build(), chunks=chunks, balance=balance, devices=["cpu"] * world,
                          schedule="pipedream", vertical_sync=vertical_sync,
                          checkpoint=checkpoint)
    local_opt = _optimizer(local.parameters(), optimizer)
    pipe = DistributedPipe(build(), chunks=chunks, balance=balance, schedule="pipedream",
                           vertical_sync=vertical_sync, checkpoint=checkpoint, timeout=60)
    opt = _optimizer(pipe.parameters(), optimizer)
    digests = []
    for step in range(steps):
        x, y = data(batch, seed=step)
        y = _targets(y, tied)
        expected = local.train_step(x, y, nn.functional.mse_loss, optimizer=local_opt)
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
        torch.testing.assert_close(loss, expected, **TOL)
        digests.append(_compare(pipe, local, f"step {step}"))
    return {"digests": digests, "names": [n for n, _ in pipe.named_parameters()]}


def _replica_rows(chunks: int, local_batch: int, replicas: int) -> List[List[int]]:
    """The rows of a global batch each replica reads, so that the Pipe's micro-batch ``i`` of
    the global batch is every replica's micro-batch ``i``, in replica order."""
    size = -(-local_batch // chunks)
    sizes = [min(size, local_batch - i * size) for i in range(chunks)]
    rows: List[List[int]] = [[] for _ in range(replicas)]
    start = 0
    for n in sizes:
        for r in range(replicas):
            rows[r] += list(range(start, start + n))
            start += n
    return rows


def data_parallel(vertical_sync: bool, tied: bool = False, steps: int = 3) -> Dict:
    """Pipeline 2 x data 2: each replica reads 7 rows (micro-batches of 2, 2, 2, 1); the Pipe
    trains on the 14 rows whose micro-batch ``i`` is both replicas' micro-batch ``i`` (4, 4,
    4, 2: a mean loss weighs every row alike). The replicas average each micro-batch's
    gradient before every update, so every rank's weights equal the Pipe's after each call."""
    mesh = init_mesh(pipeline=2, data=2)
    pp, dp = mesh
    replica = mesh.coordinate("data")
    build = tied_model if tied else model
    local = fastpipe.Pipe(build(), chunks=4, balance=[4, 4], devices=["cpu"] * 2,
                          schedule="pipedream", vertical_sync=vertical_sync)
    local_opt = _optimizer(local.parameters(), "sgd")
    pipe = DistributedPipe(build(), chunks=4, balance=[4, 4], schedule="pipedream",
                           vertical_sync=vertical_sync, process_group=pp,
                           data_parallel_group=dp, timeout=60)
    opt = _optimizer(pipe.parameters(), "sgd")
    rows = _replica_rows(4, 7, 2)[replica]
    for step in range(steps):
        x, y = data(14, seed=step)
        y = _targets(y, tied)
        expected = local.train_step(x, y, nn.functional.mse_loss, optimizer=local_opt)
        loss = pipe.train_step(x[rows], y[rows], nn.functional.mse_loss, optimizer=opt)
        torch.testing.assert_close(loss, expected, **TOL)
        _compare(pipe, local, f"replica {replica}, step {step}")
    return {"replica": replica}


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps on a micro-batch of one sample."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore
        ctx.seconds = seconds if x.shape[0] == 1 else 0.0
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore
        time.sleep(ctx.seconds)
        return grad, None


class Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SlowBackward.apply(x, self.seconds)


def _outcome(call: Callable[[], Any]) -> Dict:
    start = time.monotonic()
    try:
        call()
        return {"error": None}
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error),
                "stage": getattr(error, "stage", None), "action": getattr(error, "action", None),
                "microbatch": getattr(error, "microbatch", None),
                "seconds": time.monotonic() - start}


def slow_replica(timeout: float = 4.0) -> Dict:
    """Pipeline 2 x data 2: stage 1 of replica 1 stalls in the backward of the last
    micro-batch (one sample), longer than the timeout; its replica waits in the average of
    that micro-batch's gradient and times out naming its rank, stage, action and micro-batch."""
    mesh = init_mesh(pipeline=2, data=2)
    pp, dp = mesh
    layers = list(model())
    stalls = dist.get_rank() == 3  # stage 1, replica 1
    layers.insert(5, Slow(2 * timeout if stalls else 0.0))
    pipe = DistributedPipe(nn.Sequential(*layers), chunks=4, balance=[4, 5],
                           schedule="pipedream", process_group=pp, data_parallel_group=dp,
                           timeout=timeout)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, y = data(7)
    return _outcome(lambda: pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt))


def slow_tied_sum(timeout: float = 4.0) -> Dict:
    """A weight tied across 2 ranks: the last rank starts its share of micro-batch 1's sum
    late (past the timeout, its gradient message already sent); the first rank, which needs
    the sum for its update, times out naming its rank, stage, action and micro-batch. (The
    late rank then lingers until its sum has started, so that no collective is left pending
    when the processes end.)"""
    late_by = 2 * timeout
    if dist.get_rank() == 1:
        start_sum = TiedSync.start_sum
        calls = []

        def late(self: TiedSync, *args: Any) -> Any:
            calls.append(None)
            if len(calls) == 2:  # micro-batch 1
                time.sleep(late_by)
            return start_sum(self, *args)

        TiedSync.start_sum = late  # type: ignore[method-assign]
    pipe = DistributedPipe(tied_model(), chunks=4, balance=[4, 4], schedule="pipedream",
                           timeout=timeout)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, y = data(7)
    start = time.monotonic()
    outcome = _outcome(lambda: pipe.train_step(x, _targets(y, True), nn.functional.mse_loss,
                                               optimizer=opt))
    time.sleep(max(0.0, start + late_by + 2.0 - time.monotonic()))
    return outcome


def refused() -> Dict:
    """What stays unsupported says why: a weight tied across ranks whose first stage is not
    the pipeline's first; vertical_sync without PipeDream."""
    out = {}
    plain = model()
    plain[3][0].weight = plain[6][0].weight  # stages 1 and 3 of 4
    for label, build in (("tied_late", lambda: DistributedPipe(
            plain, chunks=4, balance=[2, 2, 2, 2], schedule="pipedream", timeout=30)),
            ("vertical_sync_1f1b", lambda: DistributedPipe(
                model(), chunks=4, schedule="1f1b", vertical_sync=True, timeout=30))):
        out[label] = _outcome(build)
    return out


def several(cases: List[List[Any]]) -> Dict:
    """Several cases in the same processes, each result under its label."""
    return {label: CASES[name](**args) for label, name, args in cases}


CASES = {f.__name__: f for f in (versions, data_parallel, slow_replica, slow_tied_sum, refused,
                                 several)}


if __name__ == "__main__":
    main(CASES)
