"""A training step of a launch-bound pipe, eager vs CUDA graphs.

Two stages of 8 small layers each (Linear(256, 256) + GELU), on one GPU (two when there are),
4 micro-batches of 1 to 64 rows per step (forward, loss, backward), timed interleaved (medians).
Launch-bound means the GPU waits for the CPU to launch kernels, which a graph replays with one
launch. Every micro-batch's forward and backward replays from the second step on; the table
counts the replays of each stage against the forwards that could replay. Needs a CUDA GPU.

    python benchmarks/graphs.py [--quick] [--rounds 30]
"""
from __future__ import annotations

import argparse
import copy
import warnings
from typing import Callable, List, Tuple

import torch
from torch import nn

import fastpipe
from _common import machine, median, table, time_interleaved

WIDTH, LAYERS, CHUNKS, WARMUP = 256, 8, 4, 3


def model() -> nn.Sequential:
    layers: List[nn.Module] = []
    for _ in range(2 * LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def step_fn(module: nn.Sequential, rows: int,
            graphs: bool) -> Tuple[Callable[[], None], fastpipe.Pipe]:
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0"] * 2
    pipe = fastpipe.Pipe(module, chunks=CHUNKS, balance=[2 * LAYERS] * 2, devices=devices,
                         checkpoint="never", schedule="1f1b", cuda_graphs=graphs)
    x, y = torch.randn(rows * CHUNKS, WIDTH), torch.randn(rows * CHUNKS, WIDTH)

    def step() -> None:
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
    return step, pipe


def replays(pipe: fastpipe.Pipe, steps: int, caught: int) -> str:
    """Each stage's forward replays, of those that could replay (all but the first step's)."""
    eligible = (steps - 1) * CHUNKS
    counts = [getattr(s.call, "replays", 0) for s in pipe._stages]
    text = ", ".join(f"{n}/{eligible}" for n in counts)
    return text if caught == 0 else f"{text} ({caught} warnings)"


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
    base = model()
    rows = []
    for batch in ((1, 16, 64) if args.quick else (1, 4, 16, 64)):
        eager, _ = step_fn(copy.deepcopy(base), batch, graphs=False)
        graphed, pipe = step_fn(copy.deepcopy(base), batch, graphs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            times = time_interleaved({"eager": eager, "graphs": graphed}, rounds,
                                     warmup=WARMUP)
        e, g = median(times["eager"]), median(times["graphs"])
        rows.append([batch, f"{e * 1e3:.3f}", f"{g * 1e3:.3f}", f"{e / g:.2f}",
                     replays(pipe, WARMUP + rounds, len(caught))])
    print(f"two stages of {LAYERS} x (Linear({WIDTH}, {WIDTH}) + GELU), {CHUNKS} micro-batches, "
          f"1F1B, forward + backward")
    print(table(["micro-batch rows", "eager ms", "graphs ms", "speed-up",
                 "replays per stage"], rows))


if __name__ == "__main__":
    main()
