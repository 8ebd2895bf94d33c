"""Step time of a Pipe with and without compiled stages (``compile=True``) on the CPU.

A small GPT-style model (``fastpipe.models.gpt``) in a 2-stage Pipe on CPU stages, 1F1B,
trained on a synthetic next-token task. The eager pipe and the compiled one (inductor, or
``--backend``) are timed in one run, interleaved round by round, after warm-up steps that
compile every graph; the table gives the median step times, their ratio, the time of the first
compiled step (what compiling costs once) and the largest difference of the two pipes' losses
on the same batches.

    python benchmarks/compile.py [--quick] [--rounds 20] [--backend inductor]
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable, Dict, List

import torch

import fastpipe
from _common import machine, median, table, time_interleaved
from fastpipe.apps.models import counting_task, gpt, lm_loss

SIZES = {  # (layers, dim, heads, seq, batch, chunks)
    "full": (8, 256, 8, 128, 32, 8),
    "quick": (2, 32, 2, 16, 8, 2),
}


def pipe_step(model: torch.nn.Module, batches: list, stages: int, chunks: int,
              compile: Any) -> Callable[[], float]:
    """One training step (forward, backward, SGD update) per call, cycling through
    ``batches``; returns the step's loss."""
    pipe = fastpipe.Pipe(model, chunks=chunks, devices=["cpu"] * stages, schedule="1f1b",
                         checkpoint="never", compile=compile)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    state = {"i": 0}

    def step() -> float:
        ids, targets = batches[state["i"] % len(batches)]
        state["i"] += 1
        optimizer.zero_grad(set_to_none=True)
        return pipe.train_step(ids, targets, lm_loss, optimizer=optimizer).item()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    layers, dim, heads, seq, batch, chunks = SIZES["quick" if args.quick else "full"]
    rounds = args.rounds or (3 if args.quick else 20)
    torch.manual_seed(0)
    base = gpt(vocab=64, dim=dim, heads=heads, layers=layers, max_len=seq)
    generator = torch.Generator().manual_seed(1)
    batches = [counting_task(batch, seq, 64, generator) for _ in range(4)]
    compiled = {} if args.backend == "inductor" else {"backend": args.backend}
    steps: Dict[str, Callable[[], float]] = {
        "eager": pipe_step(copy.deepcopy(base), batches, args.stages, chunks, False),
        f"compile ({args.backend})": pipe_step(copy.deepcopy(base), batches, args.stages,
                                               chunks, compiled or True),
    }
    losses: Dict[str, List[float]] = {}
    first: Dict[str, float] = {}
    for name, step in steps.items():  # the first steps of each: the compiled one compiles
        start = time.perf_counter()
        losses[name] = [step() for _ in range(len(batches))]
        first[name] = time.perf_counter() - start
    eager, compiled_name = list(steps)
    difference = max(abs(a - b) for a, b in zip(losses[eager], losses[compiled_name]))
    times = time_interleaved(steps, rounds, warmup=1)
    base_ms = median(times[eager]) * 1e3
    rows = []
    for name in steps:
        ms = median(times[name]) * 1e3
        rows.append([name, f"{ms:.1f}", f"{ms / base_ms:.2f}", f"{first[name]:.1f}"])
    print(f"machine: {machine()}; gpt layers={layers} dim={dim} seq={seq} batch={batch}, "
          f"{args.stages} CPU stages, {chunks} micro-batches, 1F1B; median of {rounds} "
          f"interleaved rounds")
    print(table(["pipe", "step ms (median)", "ratio to eager",
                 f"first {len(batches)} steps, s"], rows))
    print(f"largest difference of the two pipes' losses over the first {len(batches)} steps: "
          f"{difference:.2e}")


if __name__ == "__main__":
    main()
