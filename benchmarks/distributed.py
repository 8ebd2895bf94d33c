"""CPU processes on gloo: fastpipe's DistributedPipe, on both transports, against
torch.distributed.pipelining.

A compute-heavy MLP (8 x Linear(1024) with ReLU, split evenly over the ranks), 8 micro-batches
of ``--micro-batch`` samples, one thread per process. Competitors, interleaved round by round in
one run:

* plain: the whole model in one process on the whole batch (the other processes idle);
* plain loop: the same, looping over the 8 micro-batches (what a pipeline overlaps);
* fastpipe 1F1B: ``DistributedPipe(schedule='1f1b', checkpoint='never')`` with ``p2p='tagged'``
  (the default on the CPU: sends as produced) and with ``p2p='grouped'`` (the NCCL program,
  one group per round, exact sizes: what GPUs run);
* torch.distributed.pipelining: ``PipelineStage`` + ``Schedule1F1B`` on the same stages.

Every timed step starts after a barrier and ends when rank 0 finishes it. Prints medians, the
speed-ups and the pipeline efficiency = (speed-up over the loop) / (m p / (m + p - 1)).

    python benchmarks/distributed.py [--rounds 15] [--ranks 2] [--micro-batch 8]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.apps.progress import progress

STAGES = int(os.environ.get("BENCH_RANKS", 2))
WIDTH, LAYERS, CHUNKS = 1024, 8, 8
BATCH = CHUNKS * int(os.environ.get("BENCH_MICRO_BATCH", 8))


def build() -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loop: bool) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        if not loop:
            loss_fn(model(x), y).backward()
            return
        for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
    return step


def fastpipe_step(x: torch.Tensor, y: torch.Tensor, p2p: str) -> Callable[[], None]:
    from fastpipe.distributed import DistributedPipe
    pipe = DistributedPipe(build(), chunks=CHUNKS, schedule="1f1b", checkpoint="never",
                           balance=[2 * LAYERS // STAGES] * STAGES, timeout=120, p2p=p2p)

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, loss_fn)
    return step


def torch_pipelining_step(x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    rank = dist.get_rank()
    layers = list(build())
    half = len(layers) // STAGES
    part = nn.Sequential(*layers[rank * half:(rank + 1) * half])
    stage = PipelineStage(part, rank, STAGES, torch.device("cpu"))
    schedule = Schedule1F1B(stage, CHUNKS, loss_fn=loss_fn)

    def step() -> None:
        part.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == STAGES - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
    return step


def worker() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rounds = int(os.environ["BENCH_ROUNDS"])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    model = build()
    idle = lambda: None  # noqa: E731 - the second process waits while rank 0 runs alone
    candidates: Dict[str, Callable[[], None]] = {
        "plain (whole batch)": plain(model, x, y, loop=False) if rank == 0 else idle,
        "plain loop (8 micro-batches)": plain(copy.deepcopy(model), x, y, loop=True)
        if rank == 0 else idle,
        "fastpipe 1F1B (tagged)": fastpipe_step(x, y, "tagged"),
        "fastpipe 1F1B (grouped)": fastpipe_step(x, y, "grouped"),
        "torch.distributed.pipelining 1F1B": torch_pipelining_step(x, y),
    }
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    bar = progress(rounds + 2, desc="rounds") if rank == 0 else None
    for r in range(rounds + 2):  # two warm-up rounds
        for name, fn in candidates.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if rank == 0:
        print("TIMES " + json.dumps(times), flush=True)
    dist.destroy_process_group()


def launch(rounds: int) -> Dict[str, List[float]]:
    from _common import run_ranks
    out = run_ranks(__file__, STAGES, {"BENCH_ROUNDS": str(rounds), "BENCH_WORKER": "1",
                                       "BENCH_RANKS": str(STAGES),
                                       "BENCH_MICRO_BATCH": str(BATCH // CHUNKS)}, limit=1800)
    line = next(line for line in out.splitlines() if line.startswith("TIMES "))
    return json.loads(line[len("TIMES "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch")
    args = parser.parse_args()
    global STAGES, BATCH
    STAGES, BATCH = args.ranks, CHUNKS * args.micro_batch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine, median, table
    times = launch(args.rounds)
    med = {name: median(values) for name, values in times.items()}
    whole, loop = med["plain (whole batch)"], med["plain loop (8 micro-batches)"]
    ideal = CHUNKS * STAGES / (CHUNKS + STAGES - 1)
    rows = []
    for name, t in med.items():
        pipelined = "1F1B" in name
        rows.append([name, f"{t * 1e3:.1f}", f"{whole / t:.2f}", f"{loop / t:.2f}",
                     f"{loop / t / ideal:.2f}" if pipelined else "-"])
    print(f"{machine()}; {args.rounds} rounds, medians; {STAGES} processes x 1 thread, gloo; "
          f"batch {BATCH} in {CHUNKS} micro-batches")
    print(table(["", "step ms", "speed-up vs plain", "speed-up vs plain loop",
                 "pipeline efficiency"], rows))
    fast, peer = med["fastpipe 1F1B (tagged)"], med["torch.distributed.pipelining 1F1B"]
    grouped = med["fastpipe 1F1B (grouped)"]
    print(f"\nfastpipe grouped / tagged step time: {grouped / fast:.2f}; fastpipe tagged, "
          f"grouped / torch.distributed.pipelining: {fast / peer:.2f}, {grouped / peer:.2f}; "
          f"micro-batch loop / whole batch: {loop / whole:.2f} (the cost of small matrix "
          f"products alone); ideal 1F1B speed-up m p / (m + p - 1) = {ideal:.2f}")


if __name__ == "__main__":
    if os.environ.get("BENCH_WORKER") == "1":
        worker()
    else:
        main()
