"""``python -m fastpipe demo``: train a small GPT through a pipeline and watch the loss fall.

The run shows a progress bar and ends with a report: throughput, the measured bubble against
the closed form (p-1)/(m+p-1), the peak activation memory of each stage (bytes autograd saved
for backward, measured by ``fastpipe.memory``), and a picture of the last step's timeline.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any, List, Optional, Sequence, Union

import torch

from ..diagnosis.report import doctor
from ..memory import SavedActivationMeter, cuda_peaks, format_bytes
from .models import counting_task, gpt, lm_loss
from ..pipe import Pipe
from .progress import progress
from ..schedule import render


def _devices(stages: int) -> List[str]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{i % count}" for i in range(stages)]
    return ["cpu"] * stages


def _chunks(text: str) -> Union[int, str]:
    return text if text == "auto" else _positive(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a positive int, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a positive int, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from ..policies.checkpoint import MODES
    from ..schedule import SCHEDULES
    parser = argparse.ArgumentParser(prog="python -m fastpipe demo", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=_positive, default=40, help="training steps")
    parser.add_argument("--stages", type=_positive, default=2, help="pipeline stages (devices)")
    parser.add_argument("--layers", type=_positive, default=4, help="transformer blocks")
    parser.add_argument("--chunks", type=_chunks, default=4,
                        help="micro-batches per batch: a positive int, or 'auto'")
    parser.add_argument("--batch", type=_positive, default=32, help="samples per batch")
    parser.add_argument("--seq", type=_positive, default=32, help="tokens per sample")
    parser.add_argument("--schedule", default="1f1b", type=str.lower,
                        choices=[*sorted(SCHEDULES), "auto"], help="pipeline schedule")
    parser.add_argument("--virtual", type=_positive, default=None,
                        help="model chunks per stage (interleaved, looped-bfs); default: the "
                             "schedule's own (2 for zbv and dualpipev, else 1)")
    parser.add_argument("--checkpoint", default="except_last", choices=list(MODES),
                        help="what backward recomputes")
    parser.add_argument("--fused", action="store_true",
                        help="build the blocks from fastpipe.nn's fused modules")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--print-every", type=_positive, default=None,
                        help="print a loss line every N steps (default: about ten lines)")
    parser.add_argument("--measure-steps", type=_positive, default=3,
                        help="last steps traced for the bubble, memory and timeline picture")
    parser.add_argument("--picture", default=os.path.join("out", "demo_timeline.png"),
                        help="where to write the timeline PNG (needs matplotlib; '' for none)")
    return parser


def _build(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Pipe:
    """The demo's pipe; a layout the options cannot make is a usage error, not a traceback."""
    model = gpt(vocab=VOCAB, dim=64, heads=4, layers=args.layers, max_len=args.seq,
                fused=args.fused)
    try:
        return Pipe(model, chunks=args.chunks, devices=_devices(args.stages),
                    checkpoint=args.checkpoint, schedule=args.schedule,
                    virtual_stages=args.virtual)
    except (TypeError, ValueError, NotImplementedError) as error:
        parser.error(str(error))  # exits with status 2


VOCAB = 32


@dataclasses.dataclass
class _Run:
    """What the demo's training loop measured: losses, samples per second, traced timelines."""

    losses: List[float] = dataclasses.field(default_factory=list)
    rates: List[float] = dataclasses.field(default_factory=list)
    timelines: List[Any] = dataclasses.field(default_factory=list)
    last_trace: Any = None


def main(argv: Optional[List[str]] = None) -> None:
    """Parse the demo's options, build the pipeline, train it and print the report."""
    parser = _parser()
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    pipe = _build(args, parser)
    _describe(pipe, args)
    meter = SavedActivationMeter(pipe.partitions)
    run = _train(pipe, args, meter)
    losses = run.losses
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"({'falling' if losses[-1] < losses[0] else 'NOT falling'})")
    _report(pipe, args, run.rates, run.timelines, meter)
    if run.timelines:  # where the last step's time went, and what to change
        print(f"\npipeline doctor, last step:\n{doctor(run.last_trace)}")


def _train(pipe: Pipe, args: argparse.Namespace, meter: SavedActivationMeter) -> _Run:
    """Train for ``args.steps`` steps with a progress bar; the last ``measure_steps`` are
    traced and their saved activations metered."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(0)
    every = args.print_every or max(1, args.steps // 10)
    measured_from = max(1, args.steps - args.measure_steps + 1)
    run, bar = _Run(), progress(args.steps, desc="training")
    try:
        for step in range(1, args.steps + 1):
            if step == measured_from:
                meter.__enter__()
            loss = _step(pipe, args, optimizer, data, run, traced=step >= measured_from)
            bar.update(f"loss {loss:.4f}, {pipe.last_step.summary}")
            if step == 1 and args.schedule == "auto":
                bar.write(f"schedule='auto' chose {pipe.schedule} after measuring the first step")
            if step % every == 0 or step == args.steps:
                bar.write(f"step {step:3d}  loss {loss:.4f}  {pipe.last_step}")
    finally:
        bar.close()
        meter.__exit__(None, None, None)
    return run


def _step(pipe: Pipe, args: argparse.Namespace, optimizer: torch.optim.Optimizer,
          data: torch.Generator, run: _Run, traced: bool) -> float:
    """One training step on a fresh batch, timed (and traced when ``traced``)."""
    inputs, targets = counting_task(args.batch, args.seq, VOCAB, data)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    if traced:
        with pipe.trace() as trace:
            loss = pipe.train_step(inputs, targets, lm_loss, optimizer=optimizer).item()
        run.timelines.append(trace.timeline)
        run.last_trace = trace
    else:
        loss = pipe.train_step(inputs, targets, lm_loss, optimizer=optimizer).item()
    run.rates.append(args.batch / (time.perf_counter() - start))
    run.losses.append(loss)
    return loss


def _describe(pipe: Pipe, args: argparse.Namespace) -> None:
    print(f"fastpipe demo: GPT with {args.layers} blocks, "
          f"{sum(p.numel() for p in pipe.parameters()) / 1e6:.2f} M parameters")
    for index, part in enumerate(pipe.partitions):
        names = ", ".join(type(layer).__name__ for layer in part)
        device = pipe.devices[pipe.plan().stage_of(index)[0]]
        print(f"  {'chunk' if pipe.virtual_stages > 1 else 'stage'} {index} on {device}: {names}")
    schedule = ("auto (the first step runs 1F1B and measures; then the fastest is kept)"
                if args.schedule == "auto" else pipe.schedule)
    print(f"  schedule={schedule} chunks={args.chunks} virtual_stages={pipe.virtual_stages} "
          f"checkpoint={pipe.checkpoint}")


def _report(pipe: Pipe, args: argparse.Namespace, rates: Sequence[float],
            timelines: Sequence[object], meter: SavedActivationMeter) -> None:
    """The closing table, the timeline picture and where it was written."""
    p = len(pipe.devices)
    m = len(pipe._split(args.batch, pipe.chunks))
    steady = rates[-max(1, len(timelines)):]  # the traced last steps (after any search)
    bubble = statistics.mean(t.bubble_fraction for t in timelines) if timelines else float("nan")
    memory = " / ".join(format_bytes(b) for b in meter.peak_bytes)
    print()
    print(table(["schedule", "chunks", "samples/s", "bubble measured", "(p-1)/(m+p-1)",
                 "peak saved activations per stage"],
                [[pipe.schedule, str(m), f"{statistics.median(steady):.1f}", f"{bubble:.1%}",
                  f"{(p - 1) / (m + p - 1):.1%}", memory]]))
    print("memory: bytes of tensors autograd saved for backward, per stage, at their peak "
          "(checkpointed micro-batches keep only their input, not counted)")
    if any(d.type == "cuda" for d in pipe.devices):
        print("CUDA peak allocated per stage's device: "
              + " / ".join(format_bytes(b) for b in cuda_peaks(pipe.devices)))
    if pipe.chunk_search is not None:
        rates_by_count = {c: f"{pipe.chunk_search.throughput(c):.0f}"
                          for c in sorted(pipe.chunk_search.measurements)}
        print(f"chunks='auto' measured samples/s per count: {rates_by_count}")
    if timelines:
        _picture(timelines[-1], args.picture)


def _picture(timeline: object, path: str) -> None:
    print()
    print(render.ascii(timeline))
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        render.png(timeline, path)
        print(f"timeline picture written to {path}")
    except ImportError:
        print("no PNG written: matplotlib is not installed (pip install matplotlib)")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table with columns as wide as their widest cell."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(f"{c:<{w}}" for c, w in zip(line, widths)).rstrip()
                     for line in lines)
