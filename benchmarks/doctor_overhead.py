"""What the profiler labels cost per action, with and without a profiler listening.

Timed in one run, interleaved round by round: the label of one action alone (``action_range``
entered and left, against a bare ``nullcontext``), with no profiler and inside
``fastpipe.runtime.observe.profiler_ranges.profile()``; and a whole training step of 4
one-weight CPU stages with
16 micro-batches (128 actions), per action, without and with the profiler. Also the median
forward action of a one-weight stage, traced: the fixed per-action cost the doctor assumes on
the CPU (``fastpipe.runtime.observe.step_stats.CPU_ACTION_OVERHEAD``).

    python benchmarks/doctor_overhead.py [--rounds 20]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

import fastpipe
from fastpipe.runtime.observe import profiler_ranges
from _common import machine, median, table

STAGES, CHUNKS, CALLS = 4, 16, 2000


class _Stage:
    stream = None


def label_calls(profiled: bool) -> Callable[[], float]:
    """Seconds per ``action_range`` enter/exit, less a ``nullcontext`` enter/exit."""
    stage, action, nothing = _Stage(), fastpipe.Action(0, "F", 0), contextlib.nullcontext()

    def run() -> float:
        with profiler_ranges.profile() if profiled else contextlib.nullcontext():
            start = time.perf_counter()
            for _ in range(CALLS):
                with profiler_ranges.action_range(stage, action):
                    pass
            labelled = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(CALLS):
                with nothing:
                    pass
            bare = time.perf_counter() - start
        return (labelled - bare) / CALLS
    return run


def step_per_action(pipe: fastpipe.Pipe, profiled: bool) -> Callable[[], float]:
    """Seconds per action of one training step (the profiler's start and stop not timed)."""
    x, y = torch.randn(CHUNKS * 4, 1), torch.randn(CHUNKS * 4, 1)
    actions = sum(len(row) for row in pipe.plan(CHUNKS).actions)

    def run() -> float:
        with profiler_ranges.profile() if profiled else contextlib.nullcontext():
            start = time.perf_counter()
            pipe.train_step(x, y, nn.functional.mse_loss)
            return (time.perf_counter() - start) / actions
    return run


def traced_forward(pipe: fastpipe.Pipe) -> float:
    """Median seconds of a forward action of a one-weight stage."""
    x, y = torch.randn(CHUNKS * 4, 1), torch.randn(CHUNKS * 4, 1)
    with pipe.trace() as t:
        for _ in range(5):
            pipe.train_step(x, y, nn.functional.mse_loss)
    return statistics.median(e.duration for tl in t.timelines for e in tl.events
                             if e.action.kind.value == "F")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    pipe = fastpipe.Pipe(nn.Sequential(*[nn.Linear(1, 1) for _ in range(STAGES)]),
                         balance=[1] * STAGES, devices=["cpu"] * STAGES, chunks=CHUNKS,
                         schedule="1f1b", checkpoint="never")
    candidates = {"label, no profiler": label_calls(False),
                  "label, profiler active": label_calls(True),
                  "training step, no profiler": step_per_action(pipe, False),
                  "training step, profiler active": step_per_action(pipe, True)}
    for run in candidates.values():  # warm-up
        run()
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, run in candidates.items():
            samples[name].append(run())
    rows = [[name, f"{median(values) * 1e6:.2f}"] for name, values in samples.items()]
    ratio = (median(samples["training step, profiler active"])
             / median(samples["training step, no profiler"]))
    rows.append(["step with / without profiler", f"{ratio:.2f}x"])
    rows.append(["F of a one-weight stage (traced)", f"{traced_forward(pipe) * 1e6:.1f}"])
    print(table(["what (per action)", "us (median)"], rows))
    print(f"{args.rounds} rounds; {CALLS} label calls per round; steps of {STAGES} stages x "
          f"{CHUNKS} micro-batches")


if __name__ == "__main__":
    main()
