"""Distributed cases: the pipeline against the plain model, step by step.

Every schedule and checkpoint mode with uneven batches (and seeded random combinations of
them, with clipping, accumulation and resumes), float64, pipeline x data parallel, token-mean
losses, sequence lengths that change per micro-batch, and the process groups users make.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from dist_common import (TOL, WIDTH, DistributedPipe, check_grads, data, model, padded,
                         reference_grads, token_loss, token_mean_of)
from torch import nn

import fastpipe
from fastpipe.distributed import init_mesh


def transparency(schedules: List[List[Any]], batches: List[int], chunks: int = 4) -> Dict:
    """Every (schedule, virtual_stages, checkpoint) against the plain model, uneven batches
    included; also the forward-only path."""
    worst = 0.0
    for name, v, mode in schedules:
        for batch in batches:
            plain = model(depth=max(8, 2 * dist.get_world_size() * v))
            x, y = data(batch)
            ref_loss, ref = reference_grads(plain, x, y)
            pipe = DistributedPipe(model(depth=max(8, 2 * dist.get_world_size() * v)),
                                   chunks=chunks, schedule=name, virtual_stages=v,
                                   checkpoint=mode, timeout=30)
            last = len(pipe.balance) - 1  # only the ranks that read them get inputs / targets
            loss = pipe.train_step(x if 0 in pipe.stages else None,
                                   y if last in pipe.stages else None, nn.functional.mse_loss)
            where = f"{name} v={v} {mode} batch={batch}"
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
            worst = max(worst, check_grads(pipe, ref, where))
            out = pipe(x)
            if out is not None:
                torch.testing.assert_close(out, plain(x).detach(), **TOL)
    return {"worst": worst, "p2p": pipe.p2p}


def randomized(seed: int, count: int, path: Optional[str] = None) -> Dict:
    """Seeded random (schedule, checkpoint mode, chunks, transport, batch sizes, clipping,
    accumulation) drawn alike on every rank, each trained for several steps of changing batch
    sizes against the plain model (loss and every gradient, clipped by the global norm with
    ``max_grad_norm``, accumulated over the steps without zeroing): the transports' size
    caches and second phases included. With ``path``, some take SGD steps (with momentum, the
    optimizer's state) and resume from a
    ``fastpipe.checkpoint`` (saved under ``path``) into new pipes after the first step."""
    import random
    rng = random.Random(seed)
    schedules = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "looped-bfs": 2, "zb-h1": 1,
                 "zbv": 2, "dualpipev": 2}
    modes = ["never", "except_last", "always", "selective", "offload"]
    drawn = []
    for _ in range(count):
        name = rng.choice(sorted(schedules))
        world = dist.get_world_size()  # chunked schedules take m <= stages or a multiple
        v, mode = schedules[name], rng.choice(modes)
        chunks = rng.choice([c for c in range(1, 7) if v == 1 or c <= world or c % world == 0])
        p2p = rng.choice(["tagged", "grouped"])
        batches = [rng.randint(chunks, 11) for _ in range(3)]  # uneven micro-batches
        clip = rng.choice([None, 0.05, 10.0])  # clips, or not
        resume = path is not None and rng.random() < 0.4
        accumulate = not resume and rng.random() < 0.5
        depth = max(8, 2 * dist.get_world_size() * v)
        plain = model(depth=depth)

        def build(source: nn.Module) -> tuple:
            pipe = DistributedPipe(source, chunks=chunks, schedule=name, checkpoint=mode,
                                   virtual_stages=v, timeout=30, p2p=p2p)
            return pipe, (torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9) if resume
                          else None)

        pipe, opt = build(model(depth=depth))
        # SGD with momentum: Adam would magnify rounding in gradients near zero past TOL
        opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9) if resume else None
        last = len(pipe.balance) - 1
        for step, batch in enumerate(batches):
            x, y = data(batch, seed=seed + step)
            if resume and step == 1:  # saved by every rank, loaded into new pipes
                directory = os.path.join(path, f"{len(drawn)}")
                fastpipe.checkpoint.save(directory, pipe, opt)
                torch.manual_seed(len(drawn))
                fresh = model(depth=depth)
                for p in fresh.parameters():  # other values: the load must set them all
                    nn.init.normal_(p)
                pipe, opt = build(fresh)
                fastpipe.checkpoint.load(directory, pipe, opt)
            if not accumulate:
                plain.zero_grad(set_to_none=True)
                pipe.zero_grad(set_to_none=True)
            ref_loss = nn.functional.mse_loss(plain(x), y)
            ref_loss.backward()
            if clip is not None:
                ref_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), clip))
            loss = pipe.train_step(x if 0 in pipe.stages else None,
                                   y if last in pipe.stages else None, nn.functional.mse_loss,
                                   max_grad_norm=clip, optimizer=opt)
            where = (f"seed {seed}: {name} {mode} chunks={chunks} {p2p} batch={batch} "
                     f"clip={clip} accumulate={accumulate}")
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL,
                                       msg=lambda m: f"{where}: {m}")
            if clip is not None:
                assert abs(pipe.last_step.grad_norm - ref_norm) <= 1e-5 * ref_norm, where
            check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, where)
            if opt_ref is not None:
                opt_ref.step()
                after = dict(plain.named_parameters())
                for n, p in pipe.named_parameters():
                    torch.testing.assert_close(p, after[n], **TOL,
                                               msg=lambda m: f"{where}: parameter {n}: {m}")
        out = pipe.evaluate(x if 0 in pipe.stages else None)  # after training: eval mode
        if out is not None:
            with torch.no_grad():
                torch.testing.assert_close(out, plain.eval()(x), **TOL)
            plain.train()
        drawn.append([name, mode, chunks, p2p, batches, clip, accumulate, resume])
    return {"drawn": drawn}


def loss_checks() -> Dict:
    """A float64 model's loss comes back as float64 on every rank, equal to the plain model's."""
    plain = model().double()
    x, y = data(10)
    x, y = x.double(), y.double()
    ref_loss, ref = reference_grads(plain, x, y)
    pipe = DistributedPipe(model().double(), chunks=3, timeout=30)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    check_grads(pipe, ref, "float64")
    return {"dtype": str(loss.dtype)}


def data_parallel(schedule: str = "1f1b", steps: int = 2) -> Dict:
    """Pipeline 2 x data 2: gradients equal the plain model's on the global batch, over steps
    with an optimizer (so replicas must stay identical)."""
    mesh = init_mesh(pipeline=2, data=2)
    pp, dp = mesh  # the two-group form
    replica = mesh.coordinate("data")  # rank = stage * 2 + replica (pipeline outermost)
    assert replica == dist.get_rank() % 2
    plain = model()
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    pipe = DistributedPipe(model(), chunks=3, schedule=schedule, process_group=pp,
                           data_parallel_group=dp, timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = data(10, seed=step)  # the global batch; replica r reads half r
        ref_loss, ref = reference_grads(plain, x, y)
        half = slice(5 * replica, 5 * replica + 5)
        opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(x[half], y[half], nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, f"data parallel step {step}")
        opt.step()
        opt_ref.step()
        losses.append(loss.item())
    x, targets = padded(12)  # a token-mean step: counts differ between the replicas' halves
    ref_loss = token_mean_of(plain, x, targets)
    plain.zero_grad(set_to_none=True)
    ref_loss.backward()
    half = slice(6 * replica, 6 * replica + 6)
    opt.zero_grad(set_to_none=True)
    loss = pipe.train_step(x[half], (targets[0][half], targets[1][half]), token_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, "data-parallel tokens")
    return {"losses": losses}


def token_mean(schedules: List[List[Any]]) -> Dict:
    """(loss_sum, count) losses across ranks: the loss and the gradients are the plain model's
    mean over every counted position of the batch."""
    for name, v, mode in schedules:
        plain = model(depth=max(8, 2 * dist.get_world_size() * v))
        x, targets = padded(10)
        ref_loss = token_mean_of(plain, x, targets)
        ref_loss.backward()
        pipe = DistributedPipe(model(depth=max(8, 2 * dist.get_world_size() * v)), chunks=4,
                               schedule=name, virtual_stages=v, checkpoint=mode, timeout=30)
        loss = pipe.train_step(x, targets, token_loss)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, f"{name} tokens")
    return {"ok": True}


class Trim(nn.Module):
    """Shortens the sequence depending on the micro-batch size: shapes change per micro-batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] - x.shape[0] % 3]


def seq_model() -> nn.Sequential:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), Trim(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, 4))


def seq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.mean(1) - y) ** 2).mean()


def variable_shapes(schedule: str = "1f1b") -> Dict:
    """Sequence lengths that change across steps and across the micro-batches of a step."""
    plain = seq_model()
    pipe = DistributedPipe(seq_model(), chunks=4, schedule=schedule, balance=[3, 3], timeout=30)
    for step, (batch, length) in enumerate([(13, 7), (10, 5), (13, 9), (7, 7)]):
        seq_step_matches(plain, pipe, step, batch, length, "")
    return {"ok": True}


def seq_step_matches(plain: nn.Module, pipe: DistributedPipe, step: int, batch: int,
                     length: int, label: str) -> None:
    """One training step of ``pipe`` on sequences of ``length`` (4 micro-batches) gives the
    loss and gradients of ``plain`` looping over the same micro-batches."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(batch, length, WIDTH, generator=g), torch.randn(batch, 4, generator=g)
    sizes = [len(c) for c in torch.chunk(torch.arange(batch), 4)]
    plain.zero_grad(set_to_none=True)
    ref_loss = sum(seq_loss(plain(xi), yi) * (len(xi) / batch)
                   for xi, yi in zip(x.split(sizes), y.split(sizes)))
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in plain.named_parameters()}
    pipe.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, y, seq_loss)  # the first rank's loss came with a gradient
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_grads(pipe, ref, f"{label}step {step} (batch {batch}, length {length})")


def process_groups() -> Dict:
    """Process groups as users make them: a DeviceMesh dimension as the pipeline's group, a
    two-dimensional mesh refused, and ranks that disagree on the transport refused at step 1
    (before any message, instead of a hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pipeline",))
    x, y = data(6)
    plain = model()
    ref_loss, ref = reference_grads(plain, x, y)
    pipe = DistributedPipe(model(), chunks=3, process_group=mesh["pipeline"], timeout=30)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    check_grads(pipe, ref, "mesh dimension")
    out: Dict[str, Any] = {"mesh": pipe.p2p}
    two = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data", "pipe"))
    try:
        DistributedPipe(model(), process_group=two)
        raise AssertionError("a 2-D mesh was accepted as process_group")
    except fastpipe.errors.ProcessGroupError as error:
        out["two_d"] = str(error)
    mixed = "grouped" if dist.get_rank() == 0 else "tagged"
    pipe = DistributedPipe(model(), chunks=3, timeout=30, p2p=mixed)
    before = [p.detach().clone() for p in pipe.parameters()]
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        raise AssertionError("ranks on different transports ran a step")
    except (fastpipe.errors.ProcessGroupError, fastpipe.PipelineAborted) as error:
        out["mixed"] = [type(error).__name__, str(error)]
    out["untouched"] = all(torch.equal(a, b) and b.grad is None
                           for a, b in zip(before, pipe.parameters()))
    return out
