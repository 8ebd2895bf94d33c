"""Checkpoint save and load time: ``fastpipe.checkpoint`` against torch's own
``torch.distributed.checkpoint`` (with ``get_state_dict`` / ``set_state_dict``, the optimizer
flattened), side by side in one run.

An MLP (``--layers`` x Linear(``--width``) with ReLU) with its AdamW state (after one step),
written to and read from the local disk, interleaved round by round:

* DistributedPipe on 2 gloo processes (one stage each): ``fastpipe.checkpoint.save`` /
  ``load`` (model, optimizer, RNG states; atomic, checked) against torch's helpers on the same
  pipe (``get_state_dict(pipe, opt)`` then ``dcp.save``; ``dcp.load`` then ``set_state_dict``);
* one process (rank 0, the other idle): ``fastpipe.checkpoint`` on a ``Pipe`` of the same model
  against torch's helpers on the plain model.

Every timed call starts after a barrier and ends when every rank has returned. Prints the
medians of each save and load, the checkpoint's size, and fastpipe's time over torch's.

    python benchmarks/checkpoint.py [--rounds 7] [--width 1024] [--layers 8] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
RANKS = 2
Pair = Tuple[Callable[[str], None], Callable[[str], None]]  # save(dir), load(dir)


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body: List[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body)


def trained(model: nn.Module, width: int) -> torch.optim.Optimizer:
    """The model's AdamW optimizer after one step (so it has its moments)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, width)
    if hasattr(model, "train_step"):
        model.train_step(x, x, nn.functional.mse_loss)
    else:
        nn.functional.mse_loss(model(x), x).backward()
    opt.step()
    return opt


def with_fastpipe(model: nn.Module, opt: torch.optim.Optimizer) -> Pair:
    from fastpipe import checkpoint
    return (lambda d: checkpoint.save(d, model, opt),
            lambda d: checkpoint.load(d, model, opt))


def with_torch(model: nn.Module, opt: torch.optim.Optimizer, alone: bool) -> Pair:
    def save(d: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=d, no_dist=alone)

    def load(d: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=d, no_dist=alone)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=FLAT)
    return save, load


def candidates(width: int, layers: int) -> Dict[str, Any]:
    """Name -> (save, load, collective) for this rank; the one-process pairs run on rank 0."""
    import fastpipe
    rank = dist.get_rank()
    pipe = fastpipe.DistributedPipe(build(width, layers), chunks=2, balance=[2 * layers // RANKS]
                                    * RANKS, timeout=600)
    pipe_opt = trained(pipe, width)
    out: Dict[str, Any] = {
        "DistributedPipe, fastpipe.checkpoint": (*with_fastpipe(pipe, pipe_opt), True),
        "DistributedPipe, torch DCP + get/set_state_dict": (*with_torch(pipe, pipe_opt, False),
                                                            True)}
    idle = (lambda d: None, lambda d: None, False)
    local = fastpipe.Pipe(build(width, layers), chunks=2, devices=["cpu"] * 2) if rank == 0 \
        else None
    plain = build(width, layers) if rank == 0 else None
    out["Pipe, fastpipe.checkpoint"] = ((*with_fastpipe(local, trained(local, width)), False)
                                        if rank == 0 else idle)
    out["plain model, torch DCP + get/set_state_dict"] = (
        (*with_torch(plain, trained(plain, width), True), False) if rank == 0 else idle)
    return out


def size_of(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f))
               for folder, _, files in os.walk(directory) for f in files)


def worker() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rank = dist.get_rank()
    rounds, root = int(os.environ["BENCH_ROUNDS"]), os.environ["BENCH_DIR"]
    pairs = candidates(int(os.environ["BENCH_WIDTH"]), int(os.environ["BENCH_LAYERS"]))
    times: Dict[str, Dict[str, List[float]]] = {n: {"save": [], "load": []} for n in pairs}
    sizes: Dict[str, int] = {}
    for r in range(rounds + 1):  # one warm-up round
        for index, (name, (save, load, _)) in enumerate(pairs.items()):
            where = os.path.join(root, f"c{index}-r{r}")
            for kind, call in (("save", save), ("load", load)):
                dist.barrier()
                start = time.perf_counter()
                call(where)
                dist.barrier()
                if r > 0:
                    times[name][kind].append(time.perf_counter() - start)
            if rank == 0:
                sizes[name] = size_of(where)
                shutil.rmtree(where)
    if rank == 0:
        print("TIMES " + json.dumps({"times": times, "sizes": sizes}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, 2 rounds: checks that the benchmark runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.width, args.layers = 2, 32, 4
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine, median, run_ranks, table
    with tempfile.TemporaryDirectory(prefix="fastpipe-ckpt-bench-") as root:
        out = run_ranks(__file__, RANKS, {"BENCH_WORKER": "1", "BENCH_ROUNDS": str(args.rounds),
                                          "BENCH_DIR": root, "BENCH_WIDTH": str(args.width),
                                          "BENCH_LAYERS": str(args.layers)}, limit=3600)
    line = next(line for line in out.splitlines() if line.startswith("TIMES "))
    result = json.loads(line[len("TIMES "):])
    med = {name: {k: median(v) for k, v in kinds.items()}
           for name, kinds in result["times"].items()}
    rows = [[name, f"{t['save'] * 1e3:.1f}", f"{t['load'] * 1e3:.1f}",
             f"{result['sizes'][name] / 2 ** 20:.1f}"] for name, t in med.items()]
    print(f"{machine()}; {args.rounds} rounds, medians; MLP {args.layers} x {args.width} with "
          f"AdamW state; {RANKS} gloo processes x 1 thread; local disk")
    print(table(["", "save ms", "load ms", "checkpoint MiB"], rows))
    names = list(med)
    for ours, theirs, what in ((names[0], names[1], "DistributedPipe, 2 ranks"),
                               (names[2], names[3], "one process")):
        print(f"{what}: fastpipe / torch save {med[ours]['save'] / med[theirs]['save']:.2f}, "
              f"load {med[ours]['load'] / med[theirs]['load']:.2f}")


if __name__ == "__main__":
    if os.environ.get("BENCH_WORKER") == "1":
        worker()
    else:
        main()
