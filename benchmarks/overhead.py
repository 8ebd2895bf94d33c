"""Runtime cost of the pipeline machinery with tiny stages on the CPU.

4 stages of Linear(64, 64), batch 256, 8 and 32 micro-batches, no checkpointing. Competitors,
timed in one run, interleaved: fastpipe (GPipe, 1F1B), torchgpipe 0.0.7 (if installed) and the
plain model looping over the same micro-batches. Prints microseconds of overhead per
(stage, micro-batch) = (pipeline step - plain loop) / (stages x micro-batches).

    python benchmarks/overhead.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import copy
import os

# One OpenMP/MKL thread for every thread of every runner, set before torch loads: the count of
# torch.set_num_threads reaches only threads torch starts itself, and a runner's own worker
# threads (torchgpipe's) would otherwise run every kernel on all cores and spin-wait between them,
# which measures the machine's load rather than the pipeline. fastpipe's workers re-apply the
# caller's count themselves. Run with OMP_NUM_THREADS=<cores> to see the difference.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch
from torch import nn

import fastpipe
from _common import machine, median, table, time_interleaved

STAGES, WIDTH, BATCH = 4, 64, 256


def plain_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int):
    loss_fn = nn.MSELoss()

    def step() -> None:
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
    return step


def torchgpipe_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int):
    from torchgpipe import GPipe
    pipe = GPipe(model, balance=[1] * STAGES, devices=["cpu"] * STAGES, chunks=chunks,
                 checkpoint="never")

    def step() -> None:
        nn.MSELoss()(pipe(x), y).backward()
    return step


def fastpipe_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, schedule: str,
                  workers: int | None = None):
    pipe = fastpipe.Pipe(model, chunks=chunks, balance=[1] * STAGES, devices=["cpu"] * STAGES,
                         checkpoint="never", schedule=schedule, cpu_workers=workers)

    def step() -> None:
        pipe.train_step(x, y, nn.MSELoss())
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(STAGES)])
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    try:
        import torchgpipe  # noqa: F401
        have_torchgpipe = True
    except ImportError:
        have_torchgpipe = False
        print("torchgpipe not installed (pip install --no-deps torchgpipe==0.0.7): skipped")

    rows = []
    for chunks in (8, 32):
        candidates = {"plain loop": plain_loop(copy.deepcopy(base), x, y, chunks)}
        for schedule in ("gpipe", "1f1b"):
            for workers in (None, 1):
                label = f"fastpipe {schedule}" + (" (1 worker thread)" if workers else "")
                candidates[label] = fastpipe_step(copy.deepcopy(base), x, y, chunks, schedule,
                                                  workers)
        if have_torchgpipe:
            candidates["torchgpipe"] = torchgpipe_step(copy.deepcopy(base), x, y, chunks)
        times = time_interleaved(candidates, args.rounds)
        loop = median(times["plain loop"])
        ref = median(times["torchgpipe"]) if have_torchgpipe else None
        for name, values in times.items():
            step = median(values)
            overhead = (step - loop) / (STAGES * chunks) * 1e6
            ref_overhead = (ref - loop) / (STAGES * chunks) * 1e6 if ref else None
            ratio = f"{overhead / ref_overhead:.2f}" if ref_overhead and name != "plain loop" else "-"
            rows.append([chunks, name, f"{step * 1e3:.2f}",
                         "-" if name == "plain loop" else f"{overhead:.1f}", ratio])
    print(f"machine: {machine()}; 1 intra-op thread; median of {args.rounds} interleaved rounds")
    print(table(["micro-batches", "runner", "step ms (median)",
                 "overhead us per (stage, micro-batch)", "overhead / torchgpipe's"], rows))


if __name__ == "__main__":
    main()
