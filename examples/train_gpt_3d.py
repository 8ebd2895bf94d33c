"""Train a small GPT with 3-D parallelism: pipeline stages x (sharded) data parallelism x
tensor parallelism, one process per rank.

One machine, 8 CPU processes (gloo): 2 pipeline stages x 2 FSDP shards x 2 tensor-parallel
ranks (the default split of the world):

    torchrun --nproc_per_node=8 examples/train_gpt_3d.py --steps 10

Fewer ranks, other layouts (the world size must be pipeline x data x shard x tensor):

    torchrun --nproc_per_node=4 examples/train_gpt_3d.py --pipeline 2 --tensor 2
    torchrun --nproc_per_node=4 examples/train_gpt_3d.py --pipeline 2 --tensor 1   # FSDP 2
    torchrun --nproc_per_node=8 examples/train_gpt_3d.py --data 2 --shard 1        # replicas

Each transformer block's MLP is split across the tensor-parallel group (its first linear
column-wise, its second row-wise) and so is the LM head's projection; attention and the norms
stay replicated. With ``--shard`` > 1 every stage is sharded with FSDP2 over the shard group.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fastpipe
from fastpipe.apps.models import counting_task, gpt, lm_loss


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="global samples per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--pipeline", type=int, default=2, help="pipeline stages")
    parser.add_argument("--tensor", type=int, default=2, help="tensor-parallel ranks per stage")
    parser.add_argument("--data", type=int, default=1, help="replicated data-parallel ranks")
    parser.add_argument("--shard", type=int, default=None,
                        help="FSDP ranks (default: the rest of the world)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    return parser.parse_args()


def plan(layers: int) -> dict:
    """Megatron's MLP split for every block, and a column-parallel LM head whose logits are
    gathered (the loss sees whole rows); layer i + 1 of the Sequential is block i."""
    entries = {}
    for block in range(1, layers + 1):
        entries[f"{block}.mlp.0"] = ColwiseParallel()
        entries[f"{block}.mlp.2"] = RowwiseParallel()
    entries[f"{layers + 1}.proj"] = ColwiseParallel(output_layouts=Replicate())
    return entries


def main() -> None:
    args = parse()
    dist.init_process_group()  # gloo for CPU tensors, NCCL for CUDA ones (where there are GPUs)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = args.shard or max(1, world // (args.pipeline * args.data * args.tensor))
    mesh = fastpipe.init_mesh(pipeline=args.pipeline, data=args.data, shard=shard,
                              tensor=args.tensor, timeout=args.timeout,
                              device_type="cuda" if torch.cuda.is_available() else "cpu")
    if args.batch % mesh.replicas:
        raise SystemExit(f"--batch {args.batch} must divide by data x shard = {mesh.replicas}")
    with torch.device("meta"):
        model = gpt(vocab=64, dim=args.dim, heads=4, layers=args.layers, max_len=args.seq)
    torch.manual_seed(0)  # every rank materialises the same initial weights
    pipe = fastpipe.DistributedPipe(
        model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
        mesh=mesh, tensor_parallel=plan(args.layers) if args.tensor > 1 else None,
        data_parallel="fsdp" if shard > 1 else "replicate", timeout=args.timeout)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    # the ranks of one pipeline (and its tensor-parallel peers) read the same slice
    generator = torch.Generator().manual_seed(1000 + mesh.replica)
    per_replica = args.batch // mesh.replicas
    times = []
    for step in range(args.steps):
        ids, targets = counting_task(per_replica, args.seq, 64, generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.train_step(ids, targets, lm_loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}", flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in pipe.parameters())
    report = torch.tensor([peak_mb, float(held)])
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, report)
    if rank == 0:
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        print(f"{world} ranks: {mesh}; schedule {args.schedule}, {args.chunks} micro-batches: "
              f"median step {steady * 1e3:.1f} ms, {args.batch / steady:.0f} samples/s, final "
              f"loss {loss.item():.3f}")
        print("parameters held per rank: " + ", ".join(f"{int(g[1])}" for g in gathered))
        print("peak RSS per rank (MB): " + ", ".join(f"{g[0]:.0f}" for g in gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
