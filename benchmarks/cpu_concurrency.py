"""Do CPU stages overlap? 2 stages of 4 x (Linear(1024, 1024) + ReLU), batch 64, 8 micro-batches.

One intra-op thread per stage (torch.set_num_threads(1)). Competitors, timed in one run,
interleaved: fastpipe (GPipe, 1F1B), torchgpipe 0.0.7 (if installed), the plain model looping
over the same micro-batches, and the plain model on the whole batch. The goal is a speed-up over
the micro-batch loop of at least 0.85 x m*p/(m+p-1).

    python benchmarks/cpu_concurrency.py [--rounds 15]
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
from overhead import plain_loop

STAGES, CHUNKS, BATCH, WIDTH = 2, 8, 64, 1024


def build() -> nn.Sequential:
    layers = []
    for _ in range(STAGES * 4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = build()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    balance = [len(base) // STAGES] * STAGES
    candidates = {"plain loop": plain_loop(copy.deepcopy(base), x, y, CHUNKS)}
    whole = copy.deepcopy(base)
    candidates["plain whole batch"] = lambda: nn.MSELoss()(whole(x), y).backward()
    for schedule in ("gpipe", "1f1b"):
        pipe = fastpipe.Pipe(copy.deepcopy(base), chunks=CHUNKS, balance=balance,
                             devices=["cpu"] * STAGES, checkpoint="never", schedule=schedule)
        candidates[f"fastpipe {schedule}"] = (lambda p: lambda: p.train_step(x, y, nn.MSELoss()))(pipe)
    try:
        from torchgpipe import GPipe
        gp = GPipe(copy.deepcopy(base), balance=balance, devices=["cpu"] * STAGES, chunks=CHUNKS,
                   checkpoint="never")
        candidates["torchgpipe"] = lambda: nn.MSELoss()(gp(x), y).backward()
    except ImportError:
        print("torchgpipe not installed (pip install --no-deps torchgpipe==0.0.7): skipped")
    times = time_interleaved(candidates, args.rounds)
    loop = median(times["plain loop"])
    ideal = CHUNKS * STAGES / (CHUNKS + STAGES - 1)
    rows = [[name, f"{median(v) * 1e3:.1f}", f"{loop / median(v):.2f}"] for name, v in times.items()]
    print(f"machine: {machine()}; 1 intra-op thread per stage; median of {args.rounds} rounds")
    print(f"ideal speed-up m*p/(m+p-1) = {ideal:.2f}; goal >= 0.85 x ideal = {0.85 * ideal:.2f}")
    print(table(["runner", "step ms (median)", "speed-up over micro-batch loop"], rows))


if __name__ == "__main__":
    main()
