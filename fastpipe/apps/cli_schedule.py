"""``python -m fastpipe schedule --from-csv FILE``: a schedule written by PyTorch's pipelining or
torchtitan (``fastpipe.schedule.read_csv``), drawn and simulated.

It prints what ``python -m fastpipe schedule NAME`` prints for a generated schedule (the action
table and the validation report, here under the NCCL model) with the placement read from the
file, then what ``python -m fastpipe simulate`` prints: the timeline under the given per-stage
costs and its summary.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..schedule import render
from ..schedule.interchange import placement_kind
from ..schedule.interchange_csv import read_csv
from ..schedule.recommend import per_chunk_costs
from ..schedule.schedule import Schedule
from ..schedule.simulator import Costs, simulate
from ..schedule.validate import ValidationReport
from .cli_simulate import report as summary

__all__ = ["show_csv", "validation_lines"]


def show_csv(path: str, costs: str = "1,1,1", width: Optional[int] = None) -> int:
    """Read, check, draw and simulate the schedule in the CSV file at ``path``; returns the exit
    code (2, with the reason on stderr, for a file fastpipe cannot take)."""
    try:
        if width is not None and width < 1:
            raise ValueError(f"--width must be >= 1, got {width}")
        stage_costs = Costs.parse(costs)
        schedule = read_csv(path)
        checked = schedule.validate(comm="nccl")
    except (OSError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(schedule.format_table())
    print(placement_line(schedule))
    print("\n".join(validation_lines(checked)))
    result = simulate(schedule, per_chunk_costs(stage_costs, schedule))
    print()
    print(render.ascii(result.timeline, width))
    print()
    # named after the file, so that no generator's closed form is claimed for it
    print(summary(result, f"{schedule.name} (from {path})", stage_costs))
    return 0


def placement_line(schedule: Schedule) -> str:
    """The placement read from the file: its kind and each rank's stages (model order)."""
    held = "; ".join(f"rank {r} holds stages {', '.join(map(str, row))}"
                     for r, row in enumerate(schedule.placement))
    return f"placement: {placement_kind(schedule)} ({held})"


def validation_lines(checked: ValidationReport) -> list[str]:
    """The validation report's peak in-flight micro-batches and unit-cost makespan."""
    return [f"peak in-flight (chunk, micro-batch) pairs per stage: {list(checked.peak_inflight)}",
            f"makespan with unit-time actions: {checked.num_steps} rounds, "
            f"bubble {checked.bubble_fraction:.1%}"]
