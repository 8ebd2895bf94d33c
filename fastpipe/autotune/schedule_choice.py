"""``Pipe(schedule='auto')``: choose the schedule from costs measured on the pipe itself.

The first training step runs a safe default while every action is timed. The measured forward
and backward times per stage go to the simulator through ``recommend``, which ranks the
candidate schedules by predicted step time; the pipe then keeps the fastest. Candidates share
the default's placement of chunks on devices (no layer has to move): GPipe, 1F1B and ZB-H1 with
one chunk per device, interleaved 1F1B and looped BFS with several. The measured full backward
is split evenly into input- and weight-gradient halves for the zero-bubble candidates, the usual
ratio for layers dominated by matrix products. The choice never changes the gradients.
"""
from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from typing import Dict, List, Tuple

from ..schedule import SCHEDULES, Schedule, Timeline
from ..schedule.recommend import Recommendation, recommend
from ..schedule.simulator import Costs

LOG = logging.getLogger("fastpipe")
CANDIDATES = {1: ("gpipe", "1f1b", "zb-h1")}
ROUND_ROBIN = ("interleaved", "looped-bfs")


def check_name(schedule: object) -> str:
    """The lower-case schedule name, ``'auto'`` included; ``ValueError`` naming the valid ones."""
    name = schedule.lower() if isinstance(schedule, str) else None
    if name != "auto" and name not in SCHEDULES:
        valid = ", ".join(repr(n) for n in [*sorted(SCHEDULES), "auto"])
        raise ValueError(f"schedule={schedule!r} is not a known schedule; valid names: {valid}")
    return name


def first_schedule(virtual_stages: int) -> str:
    """What the first (measured) step runs: a schedule that takes any micro-batch count."""
    return "1f1b" if virtual_stages == 1 else "looped-bfs"


def stage_costs(timeline: Timeline, schedule: Schedule) -> Costs:
    """Per physical stage: the summed mean forward and backward time of its chunks."""
    spans: Dict[Tuple[str, int, int], List[float]] = defaultdict(list)
    for event in timeline.events:
        spans[(str(event.action.kind), event.action.chunk, event.stage)].append(event.duration)
    forward, backward = [], []
    for stage in range(schedule.num_stages):
        chunks = range(schedule.num_chunks)
        forward.append(sum(_mean(spans[("F", c, stage)]) for c in chunks))
        backward.append(sum(_mean(spans[("B", c, stage)]) for c in chunks))
    return Costs(forward=forward, backward=[b / 2 for b in backward],
                 weight=[b / 2 for b in backward])


def _mean(values: List[float]) -> float:
    return statistics.mean(values) if values else 0.0


def rank(timeline: Timeline, schedule: Schedule) -> List[Recommendation]:
    """The candidate schedules, fastest first, for the costs measured in ``timeline``."""
    names = CANDIDATES.get(schedule.num_chunks, ROUND_ROBIN)
    return recommend(schedule.num_stages, schedule.num_microbatches,
                     stage_costs(timeline, schedule), virtual_stages=(schedule.num_chunks,),
                     schedules=[n for n in names if n in SCHEDULES])


def log_choice(ranking: List[Recommendation]) -> None:
    """Log the chosen schedule and the predicted times of all candidates."""
    table = ", ".join(f"{r.name} {r.makespan * 1e3:.2f} ms (bubble {r.bubble_fraction:.0%})"
                      for r in ranking)
    LOG.info("schedule='auto' chose %r; simulated step times with the measured costs: %s",
             ranking[0].name, table)
