"""How fast are the pure schedule tools? Generate, validate and simulate large pipelines.

For each registered schedule: 64 stages x 512 micro-batches (goal: each step under 1 s), and the
same at smaller sizes to show how the time grows with stages x micro-batches.

    python benchmarks/simulator_scale.py
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Tuple

from fastpipe.schedule import SCHEDULES, get_schedule
from _common import machine, table

VIRTUAL = {"interleaved": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}


def timed(fn: Callable[[], object]) -> Tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="16x128,32x256,64x512")
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")]
    rows = []
    for name in sorted(SCHEDULES):
        kwargs = {"virtual_stages": VIRTUAL[name]} if name in VIRTUAL else {}
        for stages, micro in sizes:
            try:
                gen, schedule = timed(lambda: get_schedule(name, stages, micro, **kwargs))
            except (ValueError, NotImplementedError) as error:
                rows.append([name, f"{stages}x{micro}", f"unsupported: {error}", "", "", ""])
                continue
            val, _ = timed(lambda: schedule.validate(comm="buffered"))
            sim, result = timed(lambda: schedule.simulate())
            actions = sum(len(row) for row in schedule.actions)
            rows.append([name, f"{stages}x{micro}", actions, f"{gen:.3f}", f"{val:.3f}",
                         f"{sim:.3f}"])
    print(f"machine: {machine()}")
    print(table(["schedule", "stages x micro-batches", "actions", "generate s", "validate s",
                 "simulate s"], rows))


if __name__ == "__main__":
    main()
