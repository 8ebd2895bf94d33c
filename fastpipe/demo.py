"""``python -m fastpipe demo``: train a small GPT through a pipeline and watch the loss fall."""
from __future__ import annotations

import argparse
import time
from typing import List, Optional

import torch

from .models import counting_task, gpt, lm_loss
from .pipe import Pipe


def _devices(stages: int) -> List[str]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{i % count}" for i in range(stages)]
    return ["cpu"] * stages


def main(argv: Optional[List[str]] = None) -> None:
    """Parse the demo's options, build the pipeline and train it, printing a line per step."""
    parser = argparse.ArgumentParser(prog="python -m fastpipe demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    vocab = 32
    model = gpt(vocab=vocab, dim=64, heads=4, layers=args.layers, max_len=args.seq)
    pipe = Pipe(model, chunks=args.chunks, devices=_devices(args.stages),
                checkpoint=args.checkpoint, schedule=args.schedule)
    print(f"fastpipe demo: GPT with {args.layers} blocks, "
          f"{sum(p.numel() for p in pipe.parameters()) / 1e6:.2f} M parameters")
    for index, (part, device) in enumerate(zip(pipe.partitions, pipe.devices)):
        names = ", ".join(type(layer).__name__ for layer in part)
        print(f"  stage {index} on {device}: {names}")
    print(f"  schedule={pipe.schedule} chunks={pipe.chunks} checkpoint={pipe.checkpoint}")

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(0)
    first = last = None
    for step in range(1, args.steps + 1):
        inputs, targets = counting_task(args.batch, args.seq, vocab, data)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.train_step(inputs, targets, lm_loss).item()
        optimizer.step()
        elapsed = time.perf_counter() - start
        first = loss if first is None else first
        last = loss
        print(f"step {step:3d}  loss {loss:.4f}  {args.batch / elapsed:8.1f} samples/s")
    print(f"loss {first:.4f} -> {last:.4f} ({'falling' if last < first else 'NOT falling'})")
