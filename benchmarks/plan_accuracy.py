"""Does ``fastpipe plan`` predict fastpipe's own steps? Calibrate on one layer in one process,
predict the demo GPT's step on 2 and 4 gloo ranks for several layouts, run them, compare.

The calibration (``fastpipe.planning.calibrate``) times one transformer block of the demo GPT
at three micro-batch sizes in this process, one intra-op thread, and solves the planner's
achieved efficiency and per-pass cost from them; the links are gloo's over the loopback device.
Each layout (pipeline x data, schedule, chunks per stage, micro-batch count) is then predicted
with ``fastpipe.planning.predict`` under the ``fastpipe-cpu`` runtime, and run as a
``DistributedPipe`` on as many local ranks (one thread each, ``init_mesh(pipeline, data)``),
the median of ``--rounds`` steps after two warm-ups (a barrier before each, rank 0's time).
The table gives predicted against measured, the error, and each layout's rank by both; the
claim to check on a quiet machine with a core per rank: every error within 10% and the fastest
predicted layout the fastest measured.

    python benchmarks/plan_accuracy.py [--ranks 2,4 --rounds 10 --dim 256 --layers 8]
    python benchmarks/plan_accuracy.py --ranks 2 --rounds 2 --dim 64 --layers 4   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fastpipe.apps.models import Block, counting_task, gpt, lm_loss  # noqa: E402
from fastpipe.planning.calibrate import CPU_RUNTIME, calibrate  # noqa: E402
from fastpipe.planning.costs import Work  # noqa: E402
from fastpipe.planning.layout import Layout  # noqa: E402
from fastpipe.planning.model_shape import ModelShape  # noqa: E402
from fastpipe.planning.predict import predict  # noqa: E402

VOCAB = 64

# (pipeline, data, schedule, chunks per stage, micro-batches per step)
LAYOUTS = {
    2: [(2, 1, "1f1b", 1, 4), (2, 1, "1f1b", 1, 8), (2, 1, "gpipe", 1, 8),
        (2, 1, "zb-h1", 1, 8), (2, 1, "interleaved", 2, 8)],
    4: [(4, 1, "1f1b", 1, 8), (4, 1, "interleaved", 2, 8), (4, 1, "zb-h1", 1, 8),
        (2, 2, "1f1b", 1, 4), (2, 2, "1f1b", 1, 8)],
}


def shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(args.layers, args.dim, args.heads, VOCAB, name="demo gpt")


def layout_of(entry: Tuple[int, int, str, int, int], args: argparse.Namespace) -> Layout:
    pipeline, data, schedule, virtual, chunks = entry
    return Layout(pipeline=pipeline, data=data, virtual=virtual, schedule=schedule,
                  micro_batch=args.batch // (data * chunks), checkpoint="never")


def modules_per_stage(layout: Layout, layers: int) -> List[int]:
    """The pipe's balance: the planner's layers per virtual stage, the embedding on the first
    and the head on the last."""
    from fastpipe.planning.costs import even_balance
    counts = list(even_balance(layers, layout.virtual_stages))
    counts[0] += 1
    counts[-1] += 1
    return counts


def worker() -> None:
    """One rank: run every layout of this world size, print rank 0's median step times."""
    from fastpipe.distributed import DistributedPipe
    from fastpipe.parallel.mesh import init_mesh
    args = argparse.Namespace(**json.loads(os.environ["PLAN_ARGS"]))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    medians: Dict[str, float] = {}
    for entry in LAYOUTS[world]:
        layout = layout_of(entry, args)
        torch.manual_seed(0)
        model = gpt(VOCAB, args.dim, args.heads, args.layers, args.seq)
        mesh = init_mesh(pipeline=layout.pipeline, data=layout.data)
        pipe = DistributedPipe(model, chunks=entry[4], schedule=layout.schedule,
                               balance=modules_per_stage(layout, args.layers),
                               checkpoint="never", virtual_stages=layout.virtual, mesh=mesh)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        local = args.batch // layout.data
        data = torch.Generator().manual_seed(rank)
        times = []
        for step in range(args.rounds + 2):
            ids, targets = counting_task(local, args.seq, VOCAB, data)
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            pipe.train_step(ids, targets, lm_loss, optimizer=optimizer)
            if step >= 2:
                times.append(time.perf_counter() - start)
        medians[describe(entry)] = statistics.median(times)
    if rank == 0:
        print("TIMES " + json.dumps(medians), flush=True)
    dist.destroy_process_group()


def describe(entry: Tuple[int, int, str, int, int]) -> str:
    pipeline, data, schedule, virtual, chunks = entry
    chunked = f" v{virtual}" if virtual > 1 else ""
    return f"pp{pipeline} x dp{data}, {schedule}{chunked}, {chunks} micro-batches"


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine, run_ranks, table
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = shape(args)
    device = calibrate(model, args.seq, args.batch // 8,
                       layer=Block(args.dim, args.heads))
    print(machine())
    print(f"calibrated: {device.flops['fp32'] / 1e9:.3g} GFLOP/s peak, efficiency "
          f"{device.efficiency:.3g}, {device.layer_overhead * 1e3:.3g} ms per layer and pass, "
          f"{device.memory_bandwidth / 1e9:.3g} GB/s")
    for world in (int(w) for w in args.ranks.split(",")):
        out = run_ranks(os.path.abspath(__file__), world,
                        {"PLAN_WORKER": "1", "PLAN_ARGS": json.dumps(vars(args))},
                        limit=3600)
        line = next(x for x in out.splitlines() if x.startswith("TIMES "))
        measured = json.loads(line[len("TIMES "):])
        rows = []
        work = Work(model, args.seq, args.batch)
        predicted = {describe(e): predict(work, layout_of(e, args), device, CPU_RUNTIME,
                                          gpus_per_node=1 << 20).step_time
                     for e in LAYOUTS[world]}
        by_prediction = sorted(predicted, key=predicted.get)
        by_measure = sorted(measured, key=measured.get)
        for name in predicted:
            error = predicted[name] / measured[name] - 1
            rows.append([name, f"{predicted[name] * 1e3:.1f}", f"{measured[name] * 1e3:.1f}",
                         f"{error:+.1%}", by_prediction.index(name) + 1,
                         by_measure.index(name) + 1])
        print(f"\n{world} ranks, demo GPT (dim {args.dim}, {args.layers} layers, seq "
              f"{args.seq}, batch {args.batch}), {args.rounds} steps each")
        print(table(["layout", "predicted ms", "measured ms", "error", "predicted rank",
                     "measured rank"], rows))
        errors = [abs(predicted[n] / measured[n] - 1) for n in predicted]
        print(f"mean |error| {statistics.fmean(errors):.1%}, max {max(errors):.1%}; fastest "
              f"predicted is fastest measured: {by_prediction[0] == by_measure[0]}")


if __name__ == "__main__":
    if os.environ.get("PLAN_WORKER"):
        worker()
    else:
        main()
