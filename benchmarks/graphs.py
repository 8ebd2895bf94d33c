"""One stage's training step, eager vs CUDA graphs, for a launch-bound stage.

A stage of 8 small layers (Linear(256, 256) + GELU) on one GPU, one micro-batch of 1 to 64 rows
per step (forward, loss, backward), timed interleaved (medians). Launch-bound means the GPU waits
for the CPU to launch kernels, which a graph replays with one launch. Needs a CUDA GPU.

    python benchmarks/graphs.py [--quick] [--rounds 30]
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch
from torch import nn

import fastpipe
from _common import machine, median, table, time_interleaved

WIDTH, LAYERS = 256, 8


def stage_model() -> nn.Sequential:
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def step_fn(model: nn.Sequential, rows: int, graphs: bool):
    pipe = fastpipe.Pipe(model, chunks=1, balance=[len(model)], devices=["cuda:0"],
                         checkpoint="never", schedule="gpipe", cuda_graphs=graphs)
    x, y = torch.randn(rows, WIDTH), torch.randn(rows, WIDTH)

    def step() -> None:
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
    return step, pipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(machine())
    if not torch.cuda.is_available():
        print("CUDA graphs need a CUDA GPU: nothing measured on this machine.")
        return
    rounds = 10 if args.quick else args.rounds
    base = stage_model()
    rows = []
    for batch in ((1, 16, 64) if args.quick else (1, 4, 16, 64)):
        eager, _ = step_fn(copy.deepcopy(base), batch, graphs=False)
        graphed, pipe = step_fn(copy.deepcopy(base), batch, graphs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            times = time_interleaved({"eager": eager, "graphs": graphed}, rounds, warmup=3)
        replayed = bool(pipe._stages[0].call.graphs)
        e, g = median(times["eager"]), median(times["graphs"])
        rows.append([batch, f"{e * 1e3:.3f}", f"{g * 1e3:.3f}", f"{e / g:.2f}",
                     "yes" if replayed else f"no ({len(caught)} warnings)"])
    print(f"one stage of {LAYERS} x (Linear({WIDTH}, {WIDTH}) + GELU), forward + backward")
    print(table(["micro-batch rows", "eager ms", "graphs ms", "speed-up", "graph replayed"],
                rows))


if __name__ == "__main__":
    main()
