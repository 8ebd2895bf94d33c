"""3-D layouts on 4 CPU processes (gloo), and a simulated 1024-GPU scaling table.

Part 1, measured. The same model (8 blocks of Linear(768, 3072), GELU, Linear(3072, 768): 37.8M
parameters), the same global batch (64 x 768, 8 micro-batches per pipeline), AdamW, on 4
processes of one thread each, one launch per layout:

* pipeline 4 (1F1B), data 4 (one stage, gradients all-reduced), pipeline 2 x tensor 2 (each
  block's first linear column-parallel, second row-parallel), pipeline 2 x data 2,
  pipeline 2 x FSDP 2 (fastpipe's policy: parameters gathered for the whole step, gradients
  reduced once; and, for comparison, FSDP2's own: reshard after every forward and backward,
  reduce every micro-batch) and FSDP 4 (``data_parallel='fsdp'``, one stage).

Per layout: the median step time (the slowest rank's, after a barrier; 2 warm-up steps), each
rank's peak resident memory (``ru_maxrss``) and the bytes of the state it keeps between steps
(its parameters, gradients and AdamW moments).

Part 2, simulated. Per-block costs measured here (forward, backward of a block whose hidden
width is split T ways, T = 1, 2, 4, 8; one thread, 256 tokens of width 1024 per micro-batch)
feed fastpipe's schedule simulator (1F1B) for every P x D x T = 1024 layout of a 64-block model
and a global batch of 4096 micro-batches, with stated bandwidths: tensor-parallel all-reduces
inside a node, pipeline sends and data-parallel all-reduces between nodes. Printed twice: with
the costs as measured, and with compute 100x faster (a stated assumption standing for a GPU),
where communication weighs more.

    python benchmarks/three_d.py [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

WIDTH, HIDDEN, BLOCKS, BATCH, CHUNKS, WORLD = 768, 3072, 8, 64, 8, 4
LAYOUTS = {  # name: (init_mesh sizes, data_parallel, tensor-parallel plan)
    "pipeline 4": (dict(pipeline=4), "replicate", False),
    "data 4": (dict(pipeline=1, data=4), "replicate", False),
    "pipeline 2 x tensor 2": (dict(pipeline=2, tensor=2), "replicate", True),
    "pipeline 2 x data 2": (dict(pipeline=2, data=2), "replicate", False),
    "pipeline 2 x FSDP 2": (dict(pipeline=2, shard=2), "fsdp", False),
    "pipeline 2 x FSDP 2, FSDP2's own policy": (dict(pipeline=2, shard=2), "fsdp", False),
    "FSDP 4": (dict(pipeline=1, shard=4), "fsdp", False),
}


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(),
                                         nn.Linear(HIDDEN, WIDTH)) for _ in range(BLOCKS)])


def plan() -> Dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    entries: Dict[str, Any] = {}
    for i in range(BLOCKS):
        entries[f"{i}.0"], entries[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    return entries


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker() -> None:
    import fastpipe
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    name, steps = os.environ["BENCH_LAYOUT"], int(os.environ["BENCH_STEPS"])
    sizes, mode, tensor_parallel = LAYOUTS[name]
    mesh = fastpipe.init_mesh(**sizes, timeout=600)
    pipe = fastpipe.DistributedPipe(build(), chunks=CHUNKS,
                                    schedule="1f1b", checkpoint="never", mesh=mesh,
                                    tensor_parallel=plan() if tensor_parallel else None,
                                    data_parallel=mode, timeout=600)
    if "own policy" in name:  # reshard after every forward, reduce every micro-batch
        pipe.parallel.sharded_stages.set_keep_gathered(False)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    part = BATCH // mesh.replicas
    mine = slice(mesh.replica * part, (mesh.replica + 1) * part)
    times = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x[mine], y[mine], nn.functional.mse_loss, optimizer=optimizer)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        if step >= 2:
            times.append(float(elapsed))
    state = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
                for p in pipe.parameters())
    state += sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    mine_report = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, state / 2 ** 20]
    reports: List[Any] = [None] * WORLD
    dist.all_gather_object(reports, mine_report)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"times": times, "ranks": reports}), flush=True)
    dist.destroy_process_group()


def launch(name: str, steps: int) -> Dict[str, Any]:
    from _common import run_ranks
    out = run_ranks(__file__, WORLD, {"BENCH_LAYOUT": name, "BENCH_STEPS": str(steps),
                                      "BENCH_WORKER": "1"}, limit=900)
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# ------------------------------------------------------------------------------ simulation
TOKENS, SIM_WIDTH, SIM_HIDDEN, SIM_BLOCKS, SIM_MICROBATCHES, GPUS = 256, 1024, 4096, 64, 4096, 1024
TP_BANDWIDTH, TP_LATENCY = 150e9, 10e-6  # bytes/s per direction inside a node (NVLink class)
NET_BANDWIDTH, NET_LATENCY = 25e9, 20e-6  # between nodes (200 Gb/s InfiniBand), PP and DP


def block_costs(tensor: int, reps: int = 3) -> Dict[str, float]:
    """Median forward and backward seconds of one block with its hidden width split ``tensor``
    ways (this rank's share), on one thread."""
    torch.set_num_threads(1)
    block = nn.Sequential(nn.Linear(SIM_WIDTH, SIM_HIDDEN // tensor), nn.GELU(),
                          nn.Linear(SIM_HIDDEN // tensor, SIM_WIDTH))
    x = torch.randn(TOKENS, SIM_WIDTH, requires_grad=True)
    forward, backward = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = block(x)
        middle = time.perf_counter()
        out.sum().backward()
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    return {"forward": statistics.median(forward[1:]),
            "backward": statistics.median(backward[1:])}


def ring(bytes_: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce's time."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * bytes_ / bandwidth + 2 * (ranks - 1) * latency


def predict(costs: Dict[int, Dict[str, float]], scale: float) -> List[List[Any]]:
    from fastpipe.schedule import get_schedule
    from fastpipe.schedule.simulator import Costs, simulate
    activation = TOKENS * SIM_WIDTH * 4  # bytes of one micro-batch's activation (fp32)
    params_per_block = 2 * SIM_WIDTH * SIM_HIDDEN
    rows = []
    for tensor in (1, 2, 4, 8):
        for pipeline in (1, 2, 4, 8, 16, 32, 64):
            data = GPUS // (pipeline * tensor)
            if data < 1 or SIM_MICROBATCHES % data:
                continue
            m = SIM_MICROBATCHES // data
            per_stage = SIM_BLOCKS // pipeline
            allreduce = ring(activation, tensor, TP_BANDWIDTH, TP_LATENCY)  # one per block/pass
            forward = per_stage * (costs[tensor]["forward"] / scale + allreduce)
            backward = per_stage * (costs[tensor]["backward"] / scale + allreduce)
            p2p = activation / tensor / NET_BANDWIDTH + NET_LATENCY  # send-once boundaries
            schedule = get_schedule("1f1b", pipeline, m)
            result = simulate(schedule, Costs(forward=forward, backward=backward, weight=0.0,
                                              p2p=p2p if pipeline > 1 else 0.0))
            grads = per_stage * params_per_block / tensor * 4
            dp = ring(grads, data, NET_BANDWIDTH, NET_LATENCY)  # not overlapped (conservative)
            step = result.makespan + dp
            memory = per_stage * params_per_block / tensor * 16 / 2 ** 30  # fp32 + grad + Adam
            rate = SIM_MICROBATCHES * TOKENS / step
            rows.append([rate, pipeline, data, tensor, m, f"{result.bubble_fraction:.2f}",
                         f"{dp:.3f}", f"{step:.3f}", f"{rate / 1e3:.4g}", f"{memory:.2f}"])
    rows.sort(key=lambda r: -r[0])  # by throughput, the unrounded value
    return [r[1:] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine, table
    print(f"machine: {machine()}")
    rows = []
    for name in LAYOUTS:
        result = launch(name, args.steps)
        ranks = result["ranks"]
        rows.append([name, f"{statistics.median(result['times']) * 1e3:.0f}",
                     ", ".join(f"{r[0]:.0f}" for r in ranks),
                     ", ".join(f"{r[1]:.0f}" for r in ranks)])
        print(f"  {name}: done", file=sys.stderr, flush=True)
    print(f"\n4 processes x 1 thread, gloo; {BLOCKS} blocks of {WIDTH}-{HIDDEN}-{WIDTH} "
          f"({sum(p.numel() for p in build().parameters()) / 1e6:.1f}M parameters), global "
          f"batch {BATCH}, AdamW, 1F1B, checkpoint='never'; median of {args.steps} steps")
    print(table(["layout", "step ms", "peak RSS per rank (MB)",
                 "state per rank: params+grads+AdamW (MB)"], rows))
    costs = {t: block_costs(t) for t in (1, 2, 4, 8)}
    print(f"\nmeasured block costs ({TOKENS} tokens x {SIM_WIDTH}, hidden {SIM_HIDDEN}/T, one "
          f"thread): " + "; ".join(f"T={t}: F {c['forward'] * 1e3:.1f} ms, B {c['backward'] * 1e3:.1f} ms"
                                   for t, c in costs.items()))
    print(f"simulated: {SIM_BLOCKS} blocks, {SIM_MICROBATCHES} micro-batches of {TOKENS} tokens "
          f"per step over {GPUS} GPUs, 1F1B; TP all-reduce {TP_BANDWIDTH / 1e9:.0f} GB/s "
          f"(inside a node, T <= 8), pipeline and data {NET_BANDWIDTH / 1e9:.0f} GB/s; the "
          f"data-parallel all-reduce is not overlapped")
    header = ["P", "D", "T", "micro-batches / pipeline", "bubble", "DP all-reduce s", "step s",
              "k tokens/s", "state GB / GPU"]
    for scale, label in ((1.0, "compute as measured on this CPU"),
                         (100.0, "compute 100x faster (assumed, a GPU)")):
        print(f"\n{label}, top 12 layouts by throughput:")
        print(table(header, predict(costs, scale)[:12]))


if __name__ == "__main__":
    if os.environ.get("BENCH_WORKER") == "1":
        worker()
    else:
        main()
