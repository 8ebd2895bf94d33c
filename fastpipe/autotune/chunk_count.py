"""``Pipe(chunks='auto')``: find the micro-batch count with the best measured throughput.

More micro-batches shrink the pipeline bubble ((p-1)/(m+p-1) of a step) but make every action
smaller, so per-action overheads (thread hand-offs, kernel launches, small matrix products)
grow. The best count depends on the model, the batch and the machine, so it is measured: the
first training steps run candidate counts (powers of two, and multiples of the stage count),
stepping up while the throughput improves and down when the first step up made it worse, and the
pipe keeps the best. Each step is an exact step whatever its count, so the search costs only
time, never accuracy. The search is pure logic (``ChunkSearch``), driven by the front door with
measured step times.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence



LOG = logging.getLogger("fastpipe")

#: steps measured per candidate (the best is kept: the first step of a count pays for warm-up)
REPEATS = 2
#: a count must beat the best so far by this fraction of its throughput to count as better
MIN_GAIN = 0.03


def candidate_counts(num_stages: int, batch_size: int) -> List[int]:
    """Counts worth trying for a batch: powers of two and the stage count times powers of two,
    up to the batch size (a micro-batch holds at least one sample)."""
    counts = {2 ** k for k in range(batch_size.bit_length())}
    counts |= {num_stages * 2 ** k for k in range(batch_size.bit_length())}
    return sorted(c for c in counts if c <= batch_size)


def accepted(plan: Callable[[int], object], count: int) -> bool:
    """Whether ``plan(count)`` (a front door's ``plan``) makes a schedule for ``count``
    micro-batches rather than raising ``ValueError``."""
    try:
        plan(count)
    except ValueError:
        return False
    return True


def first_count(num_stages: int, valid: Callable[[int], bool]) -> int:
    """The count to start from: twice the stage count (bubble about a third), or the nearest
    smaller count the schedule accepts."""
    for count in (2 * num_stages, num_stages, 2, 1):
        if valid(count):
            return count
    return 1


class ChunkSearch:
    """Hill climbing over ``candidates`` (ascending micro-batch counts) by throughput.

    ``next()`` gives the count for the next step; ``record(count, samples, seconds)`` reports
    how long a step of ``count`` took. Once settled, ``chosen`` holds the best count and
    ``next()`` returns it for good. ``valid(count)`` screens counts the schedule cannot run.
    """

    def __init__(self, candidates: Sequence[int], start: int,
                 valid: Callable[[int], bool] = lambda count: True, *,
                 repeats: int = REPEATS, min_gain: float = MIN_GAIN) -> None:
        self.candidates = sorted(set(candidates))
        if not self.candidates:
            raise ValueError("ChunkSearch needs at least one candidate count")
        self.valid = valid
        self.repeats = repeats
        self.min_gain = min_gain
        self.measurements: Dict[int, List[float]] = {}  # count -> samples/s of each step
        self.chosen: Optional[int] = None
        self._index = max(i for i, c in enumerate(self.candidates) if c <= start) \
            if start >= self.candidates[0] else 0
        self._direction = -1
        if not valid(self.current) and not self._advance():
            raise ValueError(f"no candidate count up to {start} is valid for the schedule")
        self._start = self._best = self._index
        self._direction = 1

    @property
    def current(self) -> int:
        return self.candidates[self._index]

    def next(self) -> int:
        """The micro-batch count for the next step."""
        return self.chosen if self.chosen is not None else self.current

    def throughput(self, count: int) -> float:
        """The best measured samples per second of ``count`` (0 when unmeasured)."""
        return max(self.measurements.get(count, [0.0]))

    def record(self, count: int, samples: int, seconds: float) -> None:
        """Report a step of ``count`` micro-batches over ``samples`` samples taking ``seconds``;
        steps of other counts than ``next()`` (e.g. after settling) are ignored."""
        if self.chosen is not None or count != self.current:
            return
        runs = self.measurements.setdefault(count, [])
        runs.append(samples / max(seconds, 1e-9))
        if len(runs) >= self.repeats:
            self._judge()

    def _judge(self) -> None:
        """The current candidate is measured: keep climbing, turn back, or settle."""
        if self._index != self._start:
            if self.throughput(self.current) > self.throughput(self.candidates[self._best]) \
                    * (1 + self.min_gain):
                self._best = self._index
            elif self._direction == 1 and self._best == self._start:
                self._direction = -1  # the first step up lost: try fewer micro-batches
                self._index = self._start
            else:
                self._settle()
                return
        if not self._advance():
            if self._direction == 1 and self._best == self._start:
                self._direction, self._index = -1, self._start
                if self._advance():
                    return
            self._settle()

    def _advance(self) -> bool:
        """Move to the next valid candidate in the current direction; False at the end."""
        index = self._index + self._direction
        while 0 <= index < len(self.candidates):
            if self.valid(self.candidates[index]):
                self._index = index
                return True
            index += self._direction
        return False

    def _settle(self) -> None:
        self.chosen = self.candidates[self._best]
        table = ", ".join(f"{c}: {self.throughput(c):.1f}" for c in sorted(self.measurements))
        LOG.info("chunks='auto' chose %d micro-batches; measured samples/s per count: %s",
                 self.chosen, table)
