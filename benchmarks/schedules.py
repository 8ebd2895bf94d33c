"""Each schedule on the local executor with real CPU stages: measured vs simulated.

2 stages (one per core, one thread each) of Linear(512, 512) + Tanh layers, batch 64, 8
micro-batches, checkpoint 'never'. For each schedule: the measured step time (median) and
bubble (from ``pipe.trace()``), and the simulator's prediction fed with the per-action costs
measured in the same run. Prints a table; with ``--png`` draws simulated vs measured for one
schedule (needs matplotlib).

    python benchmarks/schedules.py [--rounds 10] [--png schedules.png]
"""
from __future__ import annotations

import argparse
import copy
import statistics
from collections import defaultdict

import torch
from torch import nn

import fastpipe
from fastpipe.schedule import SCHEDULES
from fastpipe.schedule.simulator import Costs
from _common import machine, table

STAGES, MICRO, BATCH, WIDTH, LAYERS = 2, 8, 64, 512, 8
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1),
         ("zbv", 2), ("dualpipev", 2)]


def model() -> nn.Sequential:
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def measured_costs(timeline, plan) -> Costs:
    """Per virtual stage, from a measured timeline: mean F; for B, the input-gradient B of
    micro-batches with a W and the full B of those without, which the simulator models as
    ``backward`` and ``backward + weight``; W is ``weight`` when no full B tells it."""
    spans = defaultdict(list)
    split = {(plan.virtual_stage(a.stage, a.chunk), a.microbatch)
             for row in plan.actions for a in row if str(a.kind) == "W"}
    for event in timeline.events:
        action = event.action
        chunk = plan.virtual_stage(action.stage, action.chunk)
        kind = str(action.kind)
        if kind == "B":
            kind = "B-split" if (chunk, action.microbatch) in split else "B-full"
        spans[(kind, chunk)].append(event.end - event.start)
    forward, backward, weight = [], [], []
    for k in range(plan.num_virtual_stages):
        mean = lambda kind: statistics.mean(spans[(kind, k)]) if spans[(kind, k)] else None
        f, b_split, b_full, w = mean("F"), mean("B-split"), mean("B-full"), mean("W")
        b = b_split if b_split is not None else b_full
        if b_split is not None and b_full is not None:
            wt = max(b_full - b_split, 0.0)
        else:
            wt = w if w is not None else 0.0
        forward.append(f or 0.0)
        backward.append(b or 0.0)
        weight.append(wt)
    return Costs(forward=forward, backward=backward, weight=weight)


def run_case(base: nn.Sequential, name: str, virtual: int, rounds: int, x, y):
    pipe = fastpipe.Pipe(copy.deepcopy(base), chunks=MICRO, devices=["cpu"] * STAGES,
                         checkpoint="never", schedule=name, virtual_stages=virtual,
                         cpu_workers=STAGES)
    for _ in range(3):
        pipe.train_step(x, y, nn.MSELoss())
    with pipe.trace() as trace:
        for _ in range(rounds):
            pipe.train_step(x, y, nn.MSELoss())
    steps = sorted(trace.timelines, key=lambda t: t.makespan)
    median = steps[len(steps) // 2]
    simulated = pipe.plan().simulate(measured_costs(median, pipe.plan()))
    return median, simulated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--png", default=None)
    parser.add_argument("--png-schedule", default="zb-h1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = model()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    rows, pictures = [], {}
    for name, virtual in CASES:
        if name not in SCHEDULES:
            continue
        try:
            measured, simulated = run_case(base, name, virtual, args.rounds, x, y)
        except (ValueError, NotImplementedError) as error:
            rows.append([name, virtual, f"unsupported: {error}", "", "", "", ""])
            continue
        pictures[name] = (simulated.timeline, measured)
        rows.append([name, virtual, f"{measured.makespan * 1e3:.1f}",
                     f"{simulated.makespan * 1e3:.1f}",
                     f"{measured.makespan / simulated.makespan:.2f}",
                     f"{measured.bubble_fraction:.3f}", f"{simulated.bubble_fraction:.3f}"])
    print(f"machine: {machine()}; {STAGES} stages x 1 thread; median step of {args.rounds}")
    print(table(["schedule", "v", "measured ms", "simulated ms", "measured / simulated",
                 "measured bubble", "simulated bubble"], rows))
    if args.png and args.png_schedule in pictures:
        from fastpipe.schedule.render import png_side_by_side
        png_side_by_side(*pictures[args.png_schedule], args.png)
        print(f"wrote {args.png} ({args.png_schedule}: simulated vs measured)")


if __name__ == "__main__":
    main()
