"""Training-loop cases run by every rank of a gloo group (``dist_launch.launch(...,
script='train_loop_cases.py')``): global gradient clipping, non-finite steps and gradient
accumulation, each against the plain model (which every rank builds with the same seed).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fastpipe  # noqa: E402
from dist_common import (TOL, DistributedPipe, check_full_grads, data, full, main,  # noqa: E402
                         padded, tied_model, token_loss, tp_plan)

LAYOUTS = ("pipeline", "data", "tensor", "fsdp")


def build(layout: str, source: nn.Sequential, **kwargs: Any) -> tuple:
    """A DistributedPipe of ``source`` in ``layout`` and its (replicas, replica): 'pipeline'
    (every rank a stage), 'data' (pipeline 2 x data 2), 'tensor' (pipeline 2 x tensor 2, the
    tied layers replicated), 'fsdp' (pipeline 2 x shard 2)."""
    kwargs.setdefault("timeout", 60)
    if layout == "pipeline":
        return DistributedPipe(source, **kwargs), 1, 0
    sizes = {"data": dict(data=2), "tensor": dict(tensor=2), "fsdp": dict(shard=2)}[layout]
    mesh = fastpipe.init_mesh(pipeline=dist.get_world_size() // 2, timeout=60, **sizes)
    if layout == "tensor":
        plan = tp_plan(len(source))
        for name in ("0.0", "1.0", str(len(source) - 1)):
            plan.pop(name, None)  # the tied layers stay replicated
        kwargs.update(tensor_parallel=plan)
    if layout == "fsdp":
        kwargs.update(data_parallel="fsdp")
    return DistributedPipe(source, mesh=mesh, **kwargs), mesh.replicas, mesh.replica


def source_for(layout: str) -> nn.Sequential:
    """The model of a layout: tied first and last layers, except under FSDP (no ties: the
    same layers, the last with its own weight)."""
    if layout != "fsdp":
        return tied_model()
    untied = tied_model()
    untied[-1].weight = nn.Parameter(untied[-1].weight.detach().clone())
    return untied


def batch(step: int, replicas: int, replica: int, per_replica: int = 6) -> tuple:
    """The global batch of a step and this replica's slice of it."""
    x, y = data(replicas * per_replica, seed=step)
    y = torch.cat([y, y], 1)
    mine = slice(replica * per_replica, (replica + 1) * per_replica)
    return x, y, x[mine], y[mine]


def feed(pipe: Any, x: torch.Tensor, y: Any) -> tuple:
    """The inputs and targets this rank passes (None where its stages do not read them)."""
    last = len(pipe.balance) - 1
    return (x if 0 in pipe.stages else None), (y if last in pipe.stages else None)


def plain_named(plain: nn.Module) -> Dict[str, torch.Tensor]:
    return dict(plain.named_parameters(remove_duplicate=False))


# ------------------------------------------------------------------------------ clipping
def clipping(layout: str, steps: int = 2, max_norm: float = 0.05,
             norm_type: float = 2.0) -> Dict:
    """``train_step(max_grad_norm=...)`` against the plain model clipped by torch: the same
    total norm on every rank, the same clipped gradients and parameters. SGD with momentum
    steps both: Adam's first update ``g / (|g| + eps)`` turns the last-bit differences of a
    gradient near ``eps`` (tensor parallelism sums in another order) into differences of the
    learning rate's size, which would test Adam's conditioning, not the clipping."""
    plain = source_for(layout)
    opt_ref = torch.optim.SGD(plain.parameters(), lr=1e-2, momentum=0.9)
    pipe, replicas, replica = build(layout, source_for(layout), chunks=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-2, momentum=0.9)
    norms = []
    for step in range(steps):
        x, y, mx, my = batch(step, replicas, replica)
        plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
        ref = {n: p.grad.clone() for n, p in plain_named(plain).items()}
        opt.zero_grad(set_to_none=True)
        if norm_type == 2.0:
            pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss, optimizer=None,
                            max_grad_norm=max_norm)
            norm = pipe.last_step.grad_norm
        else:
            pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss)
            norm = float(pipe.clip_grad_norm_(max_norm, norm_type=norm_type))
        assert abs(norm - float(ref_norm)) <= 1e-5 * float(ref_norm), (norm, float(ref_norm))
        check_full_grads(pipe, ref, f"{layout} clipped step {step}")
        opt.step()
        opt_ref.step()
        after = plain_named(plain)
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(full(p.detach()), after[n].detach(), **TOL,
                                       msg=lambda m: f"{layout} step {step} parameter {n}: {m}")
        norms.append(norm)
    again = float(pipe.clip_grad_norm_(1e9))  # nothing to clip: the norm as it is
    return {"norms": norms, "again": again, "ref": float(ref_norm)}


# ------------------------------------------------------------------------------ non-finite
class InfGradient(nn.Module):
    """Multiplies by a weight whose gradient is inf (the input's gradient stays finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Inf.apply(x, self.scale)


class _Inf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return grad, torch.full((1,), math.inf)


def nonfinite(layout: str, where: str, mode: str) -> Dict:
    """A NaN input on the first rank (``where='input'``) or an inf gradient on stage 0 only
    (``'stage0'``): every rank raises the same NonFiniteError (``mode='raise'``) or skips the
    optimizer step (``'skip'``), the weights and optimizer state untouched; then a clean step
    works and equals the plain model's."""
    source = source_for(layout)
    if where == "stage0":
        source = nn.Sequential(InfGradient(), *source)
    pipe, replicas, replica = build(layout, source, chunks=3)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    x, y, mx, my = batch(0, replicas, replica)
    if where == "input" and replica == 0:
        mx = mx.clone()
        mx[4, 1] = math.nan  # micro-batch 2 of replica 0
    before = {n: full(p.detach()).clone() for n, p in pipe.named_parameters()}
    found: Dict[str, Any] = {}
    try:
        pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss, optimizer=opt,
                        nonfinite=mode)
    except fastpipe.NonFiniteError as error:
        found = {"rank": error.rank, "stage": error.stage, "microbatch": error.microbatch,
                 "parameter": error.parameter, "message": str(error)}
    assert not opt.state, "the optimizer state changed"
    for n, p in pipe.named_parameters():
        assert torch.equal(full(p.detach()), before[n]), f"{n} changed"
    skipped = pipe.last_step.skipped if mode == "skip" else None
    if where == "stage0":  # every step has the inf gradient: 'ignore' lets it through
        pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss, nonfinite="ignore")
        return {"found": found, "skipped": skipped, "steps_skipped": pipe.skipped_steps}
    # the pipe goes on: a clean step equals the plain model's first step
    plain = source_for(layout)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(plain(x), y).backward()
    x, y, mx, my = batch(0, replicas, replica)
    loss = pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss, optimizer=opt)
    assert math.isfinite(float(loss))
    check_full_grads(pipe, {n: p.grad for n, p in plain_named(plain).items()}, "after")
    return {"found": found, "skipped": skipped, "steps_skipped": pipe.skipped_steps}


# ------------------------------------------------------------------------------ accumulation
def accumulation(layout: str, calls: int = 3, no_sync: bool = False,
                 tokens: bool = False) -> Dict:
    """``calls`` train_step calls without zeroing (inside ``no_sync()`` but the last, with
    ``no_sync``): the accumulated gradients equal the plain model's accumulated ``.grad`` (tied
    weights, data parallel, tensor parallel or FSDP; mean or (sum, count) losses), and the
    optimizer step of the last call equals the plain model's."""
    plain = source_for(layout)
    opt_ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    pipe, replicas, replica = build(layout, source_for(layout), chunks=3)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for call in range(calls):
        last = call == calls - 1
        if tokens:
            x, (t, mask) = padded(replicas * 6, seed=call)
            t, mask = torch.cat([t, t], 1), torch.cat([mask, mask], 1)
            total, count = token_loss(plain(x), (t, mask))
            (total / count).backward()
            mine = slice(replica * 6, replica * 6 + 6)
            args = feed(pipe, x[mine], (t[mine], mask[mine]))
            loss_fn = token_loss
        else:
            x, y, mx, my = batch(call, replicas, replica)
            nn.functional.mse_loss(plain(x), y).backward()
            args, loss_fn = feed(pipe, mx, my), nn.functional.mse_loss
        if no_sync and not last:
            with pipe.no_sync():
                pipe.train_step(*args, loss_fn)
        else:
            pipe.train_step(*args, loss_fn, optimizer=opt if last else None)
            if not last:
                check_full_grads(pipe, {n: p.grad for n, p in plain_named(plain).items()},
                                 f"{layout} after call {call}")
    # the last call stepped the optimizer: compare the parameters
    opt_ref.step()
    after = plain_named(plain)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.detach()), after[n].detach(), **TOL,
                                   msg=lambda m: f"{layout} accumulated parameter {n}: {m}")
    return {"ok": True}


def accumulation_grads(layout: str, calls: int = 3, no_sync: bool = False) -> Dict:
    """The accumulated gradients themselves after the calls (no optimizer)."""
    plain = source_for(layout)
    pipe, replicas, replica = build(layout, source_for(layout), chunks=3)
    for call in range(calls):
        x, y, mx, my = batch(call, replicas, replica)
        nn.functional.mse_loss(plain(x), y).backward()
        if no_sync and call < calls - 1:
            with pipe.no_sync():
                pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss)
        else:
            pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss)
    worst = check_full_grads(pipe, {n: p.grad for n, p in plain_named(plain).items()},
                             f"{layout} accumulated")
    return {"worst": worst}


def misuse() -> Dict:
    """Bad arguments raise typed errors before any work, on every rank alike."""
    pipe, _, _ = build("pipeline", tied_model(), chunks=3)
    x, y, mx, my = batch(0, 1, 0)
    errors: List[Optional[str]] = []
    for kwargs in (dict(max_grad_norm=0.0), dict(max_grad_norm=-1), dict(nonfinite="warn"),
                   dict(nonfinite="skip")):
        try:
            pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss, **kwargs)
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(type(error).__name__)
    assert all(p.grad is None for p in pipe.parameters()), "a refused step wrote gradients"
    with pipe.no_sync():
        pipe.train_step(*feed(pipe, mx, my), nn.functional.mse_loss)
    try:
        pipe.clip_grad_norm_(1.0)
        errors.append(None)
    except RuntimeError as error:
        errors.append(type(error).__name__)
    return {"errors": errors}


def several(runs: List[List[Any]]) -> Dict:
    """Several cases in the same processes, each result kept (in order)."""
    return {"runs": [CASES[name](**args) for name, args in runs]}


CASES = {f.__name__: f for f in (clipping, nonfinite, accumulation, accumulation_grads, misuse,
                                 several)}

if __name__ == "__main__":
    main(CASES)
