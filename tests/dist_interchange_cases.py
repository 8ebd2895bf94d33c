"""Distributed cases: schedules read from CSV files (PyTorch pipelining's / torchtitan's layout)
run by ``DistributedPipe``, every step against the plain model. Started by
``dist_launch.launch(..., script="dist_interchange_cases.py")``; ``main`` is ``dist_cases``'."""
from __future__ import annotations

import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import DistributedPipe, main, model  # noqa: E402
from dist_schedule_cases import exact_steps  # noqa: E402

from fastpipe.schedule import read_csv  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedule", "data")


def csv_schedules(files: List[str], steps: int = 2) -> Dict:
    """Each file's schedule as ``schedule=``: ``steps`` exact training steps (an uneven batch)."""
    out = {}
    for name in files:
        schedule = read_csv(os.path.join(DATA, f"{name}.csv"))
        pipe = DistributedPipe(model(), chunks=schedule.num_microbatches, schedule=schedule,
                               timeout=60)
        batch = 3 * schedule.num_microbatches - 1
        exact_steps(pipe, steps, batch=batch, seen=lambda: pipe.schedule)
        out[name] = {"schedule": pipe.schedule, "virtual": pipe.virtual_stages,
                     "chunks": pipe.chunks}
    return out


CASES = {f.__name__: f for f in (csv_schedules,)}


if __name__ == "__main__":
    main(CASES)
