"""What the end of a training step costs: the non-finite check and global gradient clipping.

``train_step(nonfinite='raise')`` (the default) reads every gradient once (per-tensor norms, one
``torch._foreach_norm`` pass) to find an inf or NaN; ``max_grad_norm=...`` uses the same norms
and then scales every gradient. Both are measured as the step time with them over the step time
without (``nonfinite='ignore'``), side by side in one run, against the plain model's step with and
without ``torch.nn.utils.clip_grad_norm_``:

* one process: ``Pipe`` on 2 CPU stages;
* two processes: ``DistributedPipe`` on 2 gloo ranks (the check's verdict travels in the step's
  closing all-gather, which every training step runs anyway).

The model: 8 x Linear(1024) with ReLU (8.4 M parameters), 8 micro-batches of ``--micro-batch``
samples, SGD steps, one intra-op thread per stage. Prints medians and ratios.

    python benchmarks/training_loop.py [--rounds 20] [--micro-batch 8] [--quick]
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

import fastpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, median, run_ranks, table, time_interleaved  # noqa: E402

WIDTH, LAYERS, CHUNKS = 1024, 8, 8
VARIANTS = {"no check (nonfinite='ignore')": dict(nonfinite="ignore"),
            "non-finite check (default)": dict(),
            "check + clip (max_grad_norm=1e-3, clips)": dict(max_grad_norm=1e-3)}


def build(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def pipe_step(pipe: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              kwargs: Dict) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt, **kwargs)
    return step


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               clip: bool) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    return step


def one_process(rounds: int, micro: int, width: int) -> List[List[object]]:
    torch.set_num_threads(1)
    x, y = torch.randn(CHUNKS * micro, width), torch.randn(CHUNKS * micro, width)
    model = build(width)
    candidates: Dict[str, Callable[[], None]] = {}
    for name, clip in (("plain model", False), ("plain model + torch clip_grad_norm_", True)):
        plain = copy.deepcopy(model)
        candidates[name] = plain_step(plain, torch.optim.SGD(plain.parameters(), lr=1e-3), x, y,
                                      clip)
    for name, kwargs in VARIANTS.items():
        pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=CHUNKS, devices=["cpu", "cpu"],
                             schedule="1f1b", checkpoint="never", cpu_workers=2)
        candidates[f"Pipe, {name}"] = pipe_step(
            pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3), x, y, kwargs)
    times = time_interleaved(candidates, rounds)
    return rows(times, [("plain model + torch clip_grad_norm_", "plain model"),
                        *[(f"Pipe, {n}", f"Pipe, {list(VARIANTS)[0]}") for n in VARIANTS]])


def rows(times: Dict[str, List[float]], pairs: List[tuple]) -> List[List[object]]:
    medians = {name: median(t) for name, t in times.items()}
    ratio = {name: medians[name] / medians[base] for name, base in pairs}
    return [[name, f"{medians[name] * 1e3:.1f}", f"{ratio.get(name, 1.0):.3f}"]
            for name in times]


# ----------------------------------------------------------------------------- per rank
def rank_main(rounds: int, micro: int, width: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x, y = torch.randn(CHUNKS * micro, width), torch.randn(CHUNKS * micro, width)
    pipes = {}
    for name, kwargs in VARIANTS.items():
        pipe = fastpipe.DistributedPipe(build(width), chunks=CHUNKS, schedule="1f1b",
                                        checkpoint="never")
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        pipes[name] = pipe_step(pipe, opt, x if rank == 0 else None,
                                y if rank == dist.get_world_size() - 1 else None, kwargs)
    times: Dict[str, List[float]] = {name: [] for name in pipes}
    for round_ in range(rounds + 3):
        for name, step in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            if round_ >= 3:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print("TIMES " + json.dumps(times), flush=True)
    dist.destroy_process_group()


def two_processes(rounds: int, micro: int, width: int) -> List[List[object]]:
    out = run_ranks(os.path.abspath(__file__), 2,
                    {"BENCH_RANK_MAIN": json.dumps([rounds, micro, width])}, limit=1800)
    line = next(l for l in out.splitlines() if l.startswith("TIMES "))
    times = {f"DistributedPipe, {k}": v for k, v in json.loads(line[6:]).items()}
    base = f"DistributedPipe, {list(VARIANTS)[0]}"
    return rows(times, [(name, base) for name in times])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the script")
    args = parser.parse_args()
    rounds, width = (2, 64) if args.quick else (args.rounds, WIDTH)
    print(f"machine: {machine()}")
    print(f"model: {LAYERS} x Linear({width}), {CHUNKS} micro-batches of {args.micro_batch}, "
          f"{rounds} rounds (medians)\n")
    results = one_process(rounds, args.micro_batch, width)
    results += two_processes(rounds, args.micro_batch, width)
    print(table(["step", "median ms", "ratio to its baseline"], results))


if __name__ == "__main__":
    if "BENCH_RANK_MAIN" in os.environ:
        rank_main(*json.loads(os.environ["BENCH_RANK_MAIN"]))
    else:
        main()
