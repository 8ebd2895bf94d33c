"""Distributed cases: schedules chosen, observed and stepped per micro-batch.

``chunks='auto'`` and ``schedule='auto'`` agreed on by every rank, ``pipe.trace()`` timelines
and the doctor's trace file, and ``schedule='pipedream'`` against the one-process Pipe.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from dist_common import (TOL, DistributedPipe, check_grads, data, full, model, reference_grads,
                         tp_plan)
from torch import nn

import fastpipe
from fastpipe.distributed import init_mesh


def exact_steps(pipe: DistributedPipe, steps: int, batch: int, seen: Callable[[], Any]) -> List:
    """Run ``steps`` training steps, each checked against the plain model (loss and every
    local gradient); returns ``seen()`` after each step."""
    plain = model()
    out = []
    for step in range(steps):
        x, y = data(batch, seed=step)
        ref_loss, ref = reference_grads(plain, x, y)
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, f"step {step} (seen: {seen()})")
        out.append(seen())
    return out


def auto_chunks(steps: int = 8) -> Dict:
    """chunks='auto': the first rank searches, every rank follows the count it announces, and
    every step is exact whatever its count."""
    pipe = DistributedPipe(model(), chunks="auto", schedule="1f1b", timeout=30)
    counts = exact_steps(pipe, steps, batch=16, seen=lambda: pipe.chunks)
    search = pipe.chunk_search
    return {"counts": counts, "chosen": None if search is None else search.chosen}


def auto_schedule(steps: int = 3) -> Dict:
    """schedule='auto': the first step runs 1F1B, traced; every rank ranks the same gathered
    timeline and keeps the same schedule; every step is exact."""
    pipe = DistributedPipe(model(), chunks=4, schedule="auto", timeout=30)
    names = exact_steps(pipe, steps, batch=8, seen=lambda: pipe.schedule)
    return {"names": names, "ranked": [r.name for r in pipe.auto_ranking]}


def traced(schedule: str = "1f1b", v: int = 1) -> Dict:
    """pipe.trace() gives every rank the whole pipeline's measured timeline."""
    pipe = DistributedPipe(model(), chunks=4, schedule=schedule, virtual_stages=v, timeout=30)
    x, y = data(8)
    with pipe.trace() as t:
        pipe.train_step(x, y, nn.functional.mse_loss)
    timeline = t.timeline
    per_stage = [sum(1 for e in timeline.events if e.stage == s)
                 for s in range(dist.get_world_size())]
    return {"per_stage": per_stage, "bubble": timeline.bubble_fraction,
            "makespan": timeline.makespan}


def doctored(path: str, wait: float = 0.2) -> Dict:
    """A traced step that waited ``wait`` seconds for its input, written by the first rank to
    ``path`` for ``python -m fastpipe doctor``; every rank's ``last_step``."""
    pipe = DistributedPipe(model(), chunks=4, schedule="1f1b", timeout=30)
    x, y = data(8)
    pipe.train_step(x, y, nn.functional.mse_loss)
    with pipe.trace() as t:
        time.sleep(wait)
        pipe.train_step(x, y, nn.functional.mse_loss)
    if dist.get_rank() == 0:
        t.write(path)
    stats = pipe.last_step
    return {"samples": stats.samples, "stages": stats.stages, "bubble": stats.bubble_fraction,
            "rate": stats.samples_per_second}


def pipedream(steps: int = 2, tensor: int = 1) -> Dict:
    """schedule='pipedream' across processes: each rank steps its stage per micro-batch with
    the weight version that micro-batch's forward used; the parameters after each call equal
    (gathered, with ``tensor`` > 1: pipeline 2 x tensor parallel) those of the one-process Pipe
    running the same schedule."""
    local = fastpipe.Pipe(model(), chunks=4, balance=[4, 4], devices=["cpu", "cpu"],
                          schedule="pipedream")
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    layout: Dict[str, Any] = {"timeout": 30} if tensor == 1 else {
        "mesh": init_mesh(pipeline=2, tensor=tensor, timeout=60),
        "tensor_parallel": tp_plan(8), "timeout": 60}
    pipe = DistributedPipe(model(), chunks=4, balance=[4, 4], schedule="pipedream", **layout)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = data(8, seed=step)
        expected = local.train_step(x, y, nn.functional.mse_loss, optimizer=local_opt)
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
        torch.testing.assert_close(loss, expected, **TOL)
        after = dict(local.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full(p.detach()), after[name].detach(), **TOL,
                                       msg=lambda m: f"pipedream step {step}, {name}: {m}")
    start = dict(model().named_parameters())
    return {"moved": all(not torch.equal(full(p.detach()), start[n].detach())
                         for n, p in pipe.named_parameters())}
