"""How many threads run the CPU stages: a fixed number, or one adapted to the stages' work.

Threads let CPU stages overlap, but every hand-off between threads costs tens of microseconds
(a wake-up and the GIL). When the measured time per action is that small, one thread running all
CPU stages is faster; when actions are long, one thread per core overlaps them. The choice never
changes results: each stage runs its actions in the same order on any thread.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import torch

from ..placement import worker_groups
from ..runtime.executor import LocalExecutor
from ..runtime.step import StepState

#: Below this mean action time (seconds) the CPU stages share one thread ...
SMALL_ACTION_S = 200e-6
#: ... and above this one they get one thread per core again (hysteresis between the two).
LARGE_ACTION_S = 400e-6


class WorkerPolicy:
    """Owns the executors of a pipe and picks the one for the next step."""

    def __init__(self, devices: Sequence[torch.device], cpu_workers: Optional[int]) -> None:
        self.devices = list(devices)
        self.adaptive = cpu_workers is None
        cpu_stages = sum(1 for d in self.devices if d.type == "cpu")
        self.most = max(1, min(cpu_stages, cpu_workers or os.cpu_count() or 1))
        self.current = self.most
        self._executors: Dict[int, LocalExecutor] = {}

    def executor(self) -> LocalExecutor:
        """The executor with the current number of CPU threads (made on first use)."""
        if self.current not in self._executors:
            groups = worker_groups(self.devices, self.current)
            self._executors[self.current] = LocalExecutor(groups)
        return self._executors[self.current]

    def observe(self, step: StepState) -> None:
        """After a step, move between one thread and one per core by the mean action time."""
        if not self.adaptive or self.most == 1 or not step.completed:
            return
        mean = sum(step.busy) / step.completed
        if self.current > 1 and mean < SMALL_ACTION_S:
            self.current = 1
        elif self.current == 1 and mean > LARGE_ACTION_S:
            self.current = self.most

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown()
