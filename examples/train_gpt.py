"""Train a small GPT with one pipeline stage per process.

One machine, 2 processes (CPU stages over gloo; with GPUs, one GPU per rank over NCCL):

    torchrun --nproc_per_node=2 examples/train_gpt.py --steps 30

Several machines (run on each; one of them is the rendezvous host):

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=gpt examples/train_gpt.py --data-parallel 2

Every rank builds the model on the ``meta`` device and materialises only its own layers with
their ``reset_parameters`` (seeded alike on every rank, so data-parallel replicas start equal; to
start from given weights, ``pipe.load_state_dict`` a plain-model checkpoint).
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist

import fastpipe
from fastpipe.distributed import DistributedPipe, init_mesh
from fastpipe.apps.models import counting_task, gpt, lm_loss
from fastpipe.schedule import render


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="samples per pipeline per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="pipelines side by side (world size = stages x this)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--p2p", default="auto", choices=["auto", "tagged", "grouped"],
                        help="transport: the NCCL program (grouped, the default on GPUs) or "
                             "sends as produced (tagged, gloo only)")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="trace the last step: print its timeline and the doctor's report "
                             "(rank 0) and write it as Chrome/Perfetto trace JSON")
    return parser.parse_args()


def main() -> None:
    args = parse()
    dist.init_process_group()  # gloo for CPU tensors, NCCL for CUDA ones (when there are GPUs)
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = world // args.data_parallel
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_mesh(pipeline=stages, data=args.data_parallel, device_type=device_type)
    pipeline_group, data_group = mesh  # rank = stage * data_parallel + replica
    replica = mesh.coordinate("data")
    with torch.device("meta"):
        model = gpt(vocab=64, dim=args.dim, heads=4, layers=args.layers, max_len=args.seq)
    torch.manual_seed(0)  # replicas of a stage materialise the same initial weights
    pipe = DistributedPipe(model, chunks=args.chunks, schedule=args.schedule,
                           checkpoint=args.checkpoint, process_group=pipeline_group,
                           data_parallel_group=data_group, timeout=args.timeout, p2p=args.p2p)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 + replica)  # each replica its own data
    times = []
    for step in range(args.steps):
        ids, targets = counting_task(args.batch, args.seq, 64, generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        traced = args.trace is not None and step == args.steps - 1
        with pipe.trace() if traced else contextlib.nullcontext() as t:
            loss = pipe.train_step(ids, targets, lm_loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            # pipe.last_step: this step's samples/s and its stage's measured bubble share
            print(f"step {step:3d}  loss {loss.item():.3f}  {pipe.last_step}", flush=True)
    if rank == 0 and args.trace is not None:
        print(render.ascii(t.timeline))
        t.write(args.trace)  # then: python -m fastpipe doctor FILE.json
        print(fastpipe.doctor(t))
    if rank == 0:
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        print(f"{world} ranks ({stages} stages x {args.data_parallel} replicas) on "
              f"{pipe.device.type}, {pipe.p2p} p2p, schedule "
              f"{args.schedule}, {args.chunks} micro-batches: median step {steady * 1e3:.1f} ms, "
              f"{args.batch * args.data_parallel / steady:.0f} samples/s, final loss "
              f"{loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
