"""Train a small GPT that survives the death of a rank: torchrun restarts the job and it resumes
from its last complete checkpoint.

One machine, 2 stages, up to 3 restarts (CPU stages over gloo; with GPUs, one GPU per rank):

    torchrun --nproc_per_node=2 --max-restarts=3 examples/train_elastic.py --dir ckpts

Kill any rank while it trains (``kill -9 PID``): the other ranks stop within seconds, torchrun
starts every rank again, and they continue from the last checkpoint in ``--dir``. Each step's
batch is a function of the step number and the checkpoint holds the model, the optimizer, the
learning-rate schedule and every rank's RNG state, so the weights at the end are bit for bit those
of a run that was never interrupted. The script uses AdamW, a warm-up and cosine learning-rate
schedule, gradient clipping by the whole model's norm, gradient accumulation under
``pipe.no_sync()`` and an embedding tied to the LM head across the first and last ranks.

``fastpipe.distributed.init_process_group`` (not torch's) builds the process group: under
torchrun's agent, whose key-value store every attempt of the job shares, it keeps each attempt's
keys apart (torch's own ``init_process_group`` can pick up the addresses of the previous
attempt's dead ranks and fail in gloo's ``connectFullMesh``, or hang).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import fastpipe.checkpoint as ckpt
from fastpipe.apps.models import counting_task, gpt, lm_loss
from fastpipe.distributed import DistributedPipe, init_process_group

VOCAB = 64


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="ckpts", help="where checkpoints go (step-NNNNNN/)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--accumulate", type=int, default=2,
                        help="batches per optimizer step (1: no gradient accumulation)")
    parser.add_argument("--batch", type=int, default=16, help="samples per batch")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip by the whole model's gradient norm (0: no clipping)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds any wait of the pipeline may take")
    parser.add_argument("--pg-timeout", type=float, default=600.0,
                        help="seconds torch's own collectives (in checkpoint saves and loads) "
                             "may wait for a rank that failed")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    for name in ("steps", "save_every", "accumulate", "batch", "chunks", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    return args


@dataclass
class Trained:
    """What a run leaves: the pipe, its optimizer, and the step it started from (0, or the
    step after the checkpoint it resumed from)."""

    pipe: DistributedPipe
    optimizer: torch.optim.Optimizer
    resumed_at: int


def build(args: argparse.Namespace) -> Tuple[DistributedPipe, torch.optim.Optimizer,
                                              torch.optim.lr_scheduler.LRScheduler]:
    """The pipe (one stage per rank, the embedding tied to the LM head), AdamW and a warm-up
    plus cosine schedule, in the state of a fresh start."""
    with torch.device("meta"):  # each rank materialises its own layers only
        model = gpt(vocab=VOCAB, dim=args.dim, heads=4, layers=args.layers, max_len=args.seq,
                    dropout=args.dropout)
    torch.manual_seed(args.seed)  # the same initial weights on every attempt
    head = len(model) - 1
    pipe = DistributedPipe(model, chunks=args.chunks, schedule=args.schedule,
                           tied=[("0.tokens.weight", f"{head}.proj.weight")],
                           timeout=args.timeout)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup,
                                                                           args.steps))
    return pipe, optimizer, scheduler


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor of step ``s``: linear warm-up, then a cosine decay to 10%."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def batch(args: argparse.Namespace, step: int, part: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batch ``part`` of optimizer step ``step``: a function of the two numbers only, so a run
    resumed at any step sees the same data as one that never stopped."""
    seed = (args.seed * 1_000_003 + step) * 1009 + part
    return counting_task(args.batch, args.seq, VOCAB, torch.Generator().manual_seed(seed))


def resume(args: argparse.Namespace, pipe: DistributedPipe, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """Load the last complete checkpoint under ``--dir`` (every rank); the step to run next."""
    last = ckpt.latest(args.dir)
    if last is None:
        return 0
    extra = ckpt.load(last, pipe, optimizer, scheduler)
    if dist.get_rank() == 0:
        print(f"resumed from {last} at step {extra['step']}", flush=True)
    return int(extra["step"])


def train_step(args: argparse.Namespace, pipe: DistributedPipe,
               optimizer: torch.optim.Optimizer, step: int) -> float:
    """One optimizer step over ``--accumulate`` batches: gradients accumulate under
    ``no_sync()`` (the tied weights' gradients are summed across ranks once, on the last),
    then are clipped by the whole model's norm and AdamW steps. The mean loss of the batches."""
    optimizer.zero_grad(set_to_none=True)
    parts = args.accumulate
    loss_fn = lm_loss if parts == 1 else (lambda out, tgt: lm_loss(out, tgt) / parts)
    clip = args.max_grad_norm if args.max_grad_norm > 0 else None
    total = 0.0
    for part in range(parts):
        ids, targets = batch(args, step, part)
        last = part == parts - 1
        with contextlib.nullcontext() if last else pipe.no_sync():
            loss = pipe.train_step(ids, targets, loss_fn,
                                   optimizer=optimizer if last else None,
                                   max_grad_norm=clip if last else None)
        total += loss.item()
    return total  # each part's loss was divided by the number of parts


def train(args: argparse.Namespace,
          on_step: Optional[Callable[[int], None]] = None) -> Trained:
    """Build (or resume) and train to ``--steps``, saving a checkpoint every ``--save-every``
    steps and after the last; ``on_step(step)`` runs before each step (for tests)."""
    pipe, optimizer, scheduler = build(args)
    first = resume(args, pipe, optimizer, scheduler)
    for step in range(first, args.steps):
        if on_step is not None:
            on_step(step)
        lr = scheduler.get_last_lr()[0]
        loss = train_step(args, pipe, optimizer, step)
        scheduler.step()
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            ckpt.save(os.path.join(args.dir, f"step-{done:06d}"), pipe, optimizer, scheduler,
                      extra={"step": done})
        if dist.get_rank() == 0 and (step % args.log_every == 0 or done == args.steps):
            norm = pipe.last_step.grad_norm if pipe.last_step is not None else float("nan")
            print(f"step {step:4d}  loss {loss:.4f}  grad norm {norm:.3f}  "
                  f"lr {lr:.2e}", flush=True)
    return Trained(pipe, optimizer, first)


def start(args: argparse.Namespace) -> None:
    """The default process group: gloo for CPU tensors, NCCL for CUDA ones, built so that
    a restarted attempt of the job finds none of the earlier attempts' keys in torchrun's
    store."""
    init_process_group(timeout=datetime.timedelta(seconds=args.pg_timeout))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)
    start(args)
    train(args)  # on a failure: raise, exit non-zero, and torchrun starts the job again
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
