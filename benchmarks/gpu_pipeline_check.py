"""Pipelines on GPUs, exact against the plain model: part of ``benchmarks/gpu_check.sh``.

    python benchmarks/gpu_pipeline_check.py pipe
        one process, ``Pipe`` with two stages on ``cuda:0``, every schedule;
    torchrun --standalone --nproc_per_node=N benchmarks/gpu_pipeline_check.py distributed
        ``DistributedPipe`` over NCCL, one GPU per rank (N <= the GPUs: NCCL cannot put two
        ranks on one GPU), every schedule on the grouped transport, then step times and the
        blocking reads of device buffers per step (``last_step.host_reads``, on every rank).

Each prints one line per schedule (worst relative gradient error, loss error) and fails
(non-zero exit) on any mismatch beyond fp32 tolerance, or (distributed) when a step of the
grouped transport read device buffers on the host more than once: the transport reads none,
and the close of a step reads once, for the check of ``nonfinite='raise'`` (the default).
"""
from __future__ import annotations

import os
import sys
import time
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES: List[Tuple[str, int]] = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 2),
                                    ("dualpipev", 2)]
WIDTH, BATCH, CHUNKS = 256, 24, 4
TOL = dict(rtol=1e-4, atol=1e-5)  # TF32 is off below: fp32 matrix products on both sides


def model(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())]
    return nn.Sequential(*layers)


def reference(depth: int, device: torch.device, x: torch.Tensor, y: torch.Tensor):
    plain = model(depth).to(device)
    loss = nn.functional.mse_loss(plain(x.to(device)), y.to(device))
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in plain.named_parameters()}


def compare(name: str, loss: torch.Tensor, ref_loss: torch.Tensor, grads, ref) -> float:
    torch.testing.assert_close(loss.cpu(), ref_loss, **TOL)
    worst = 0.0
    for key, grad in grads:
        expected = ref[key]
        torch.testing.assert_close(grad.cpu(), expected, **TOL, msg=lambda m: f"{name} {key}: {m}")
        worst = max(worst, float((grad.cpu() - expected).abs().max() / expected.abs().max()))
    return worst


def pipe_on_one_gpu(device: torch.device = torch.device("cuda:0")) -> None:
    import fastpipe
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH + 3, WIDTH, generator=g), torch.randn(BATCH + 3, WIDTH, generator=g)
    for name, v in SCHEDULES:
        depth = 4 * v
        ref_loss, ref = reference(depth, device, x, y)
        pipe = fastpipe.Pipe(model(depth), chunks=CHUNKS, devices=[device, device],
                             schedule=name, virtual_stages=v, checkpoint="except_last")
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        worst = compare(name, loss, ref_loss,
                        [(n, p.grad) for n, p in pipe.named_parameters()], ref)
        print(f"Pipe on {device} x2, {name:12s} v={v}: exact (worst relative error {worst:.1e})",
              flush=True)


def distributed_over_nccl() -> None:
    from fastpipe.distributed import DistributedPipe
    dist.init_process_group()  # NCCL for CUDA tensors, gloo for CPU ones
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH + 3, WIDTH, generator=g), torch.randn(BATCH + 3, WIDTH, generator=g)
    for name, v in SCHEDULES:
        depth = 2 * world * v
        pipe = DistributedPipe(model(depth), chunks=CHUNKS, schedule=name, virtual_stages=v,
                               timeout=60)
        assert pipe.device.type == "cuda" and pipe.p2p == "grouped", (pipe.device, pipe.p2p)
        ref_loss, ref = reference(depth, pipe.device, x, y)
        loss = pipe.train_step(x if 0 in pipe.stages else None,
                               y if len(pipe.balance) - 1 in pipe.stages else None,
                               nn.functional.mse_loss)
        worst = compare(name, loss, ref_loss,
                        [(n, p.grad) for n, p in pipe.named_parameters()], ref)
        times, reads = [], [pipe.last_step.host_reads]
        for _ in range(10):
            pipe.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            pipe.train_step(x if 0 in pipe.stages else None,
                            y if len(pipe.balance) - 1 in pipe.stages else None,
                            nn.functional.mse_loss)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            reads.append(pipe.last_step.host_reads)
        step = sorted(times)[len(times) // 2]
        every = [None] * world
        dist.all_gather_object(every, reads)
        if rank == 0:
            print(f"DistributedPipe NCCL x{world}, {name:12s} v={v}: exact (worst relative "
                  f"error {worst:.1e}), median step {step * 1e3:.2f} ms, host reads per step "
                  f"(first, then steady, per rank) {[(r[0], max(r[1:])) for r in every]}",
                  flush=True)
        assert all(n == 1 for r in every for n in r), f"{name}: host reads per step {every}"
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not torch.cuda.is_available():
        sys.exit("no GPU visible")
    mode = sys.argv[1] if len(sys.argv) > 1 else "pipe"
    if mode == "pipe":
        pipe_on_one_gpu()
    elif mode == "distributed":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        distributed_over_nccl()
    else:
        sys.exit(f"unknown mode {mode!r}: pipe or distributed")
